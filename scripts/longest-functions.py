#!/usr/bin/env python3
"""The longest function definitions of the code folders: in C++ (.cpp, .cu) a brace counter over namespace-level
definitions, signature lines included (member functions defined in a class body are not counted); in Python every
function and method, from its `def` to its last line (ast).
Usage: scripts/longest-functions.py [ROOT] [N]        the N longest (default: this checkout, 10)
       scripts/longest-functions.py --max 80 [ROOT]   exit 1 naming every function over 80 lines
       scripts/longest-functions.py --self-test       a planted 81-line function in each language is caught"""
import ast
import re
import sys
import tempfile
from pathlib import Path

LIBRARY = ("core", "backends", "artifact", "serve", "runtime", "io", "eval", "fit", "tools", "apps", "python/src",
           "python/crosskv", "examples", "scripts", "slurm")  # not bench/: measurement drivers, not the product


def python_functions(path):
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError as e:
        sys.exit(f"longest-functions.py: {path}: {e}")
    return [(n.end_lineno - n.lineno + 1, n.name, str(path)) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def functions(path):
    out, depth, start, text = [], 0, None, ""
    name = None
    for i, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = re.sub(r"//.*", "", raw)
        line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
        line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
        if depth == 0:
            stripped = line.strip()
            if re.match(r"^(namespace\b.*\{|\}\s*$|extern \"C\"|#)", stripped) or not stripped:
                if not stripped or stripped.startswith("#") or stripped.startswith("namespace") or stripped == "}":
                    start, text = None, ""
                    continue
            if start is None:
                start, text = i, ""
            text += " " + line
        opens, closes = line.count("{"), line.count("}")
        if depth == 0 and opens > closes:
            head = text.split("{")[0]
            m = re.search(r"([A-Za-z_][A-Za-z0-9_:~<>]*)\s*\(", head)
            kind = re.match(r"\s*(template\s*<[^>]*>\s*)?(struct|class|enum|union)\b", head)
            name = m.group(1) if m and not kind and "=" not in head.split("(")[0] else None
            fstart = start
        depth += opens - closes
        if depth == 0 and (opens or closes):
            if name:
                out.append((i - fstart + 1, name, str(path)))
            name, start, text = None, None, ""
    return out


def all_functions(root, folders=LIBRARY):
    found = []
    missing = [f for f in folders if not (root / f).is_dir()]
    if missing:  # a folder renamed or gone: the list above is stale
        sys.exit(f"longest-functions.py: no folder {', '.join(missing)} under {root}; update LIBRARY")
    for folder in folders:
        for p in sorted((root / folder).rglob("*")):
            if "emulation" in p.parts or not p.is_file():
                continue
            if p.suffix in (".cpp", ".cu"):
                found += [(length, name, str(p.relative_to(root))) for length, name, _ in functions(p)]
            elif p.suffix == ".py":
                found += [(length, name, str(p.relative_to(root))) for length, name, _ in python_functions(p)]
    return sorted(found, reverse=True)


def over(root, limit, folders=LIBRARY):
    long = [f for f in all_functions(root, folders) if f[0] > limit]
    for length, name, where in long:
        print(f"{length:5d}  {name}  ({where}): over {limit} lines")
    return long


def self_test():
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "lib").mkdir()
        body = "".join(f"  x += {i};\n" for i in range(79))
        (root / "lib" / "a.cpp").write_text(f"int fine() {{\n  return 1;\n}}\n\nint planted(int x) {{\n{body}}}\n")
        (root / "lib" / "b.py").write_text("def fine():\n    return 1\n\n\ndef planted():\n    x = 0\n" +
                                           "".join(f"    x += {i}\n" for i in range(79)))
        got = sorted((n, w) for _, n, w in over(root, 80, ("lib",)))
        want = [("planted", "lib/a.cpp"), ("planted", "lib/b.py")]
        if got != want:
            sys.exit(f"longest-functions.py --self-test: found {got}, planted {want}")
    print("the planted 81-line C++ and Python functions are caught")


def main():
    args = sys.argv[1:]
    if args == ["--self-test"]:
        return self_test()
    if args[:1] == ["--max"]:
        root = Path(args[2] if len(args) > 2 else Path(__file__).resolve().parents[1])
        sys.exit(1 if over(root, int(args[1])) else 0)
    root = Path(args[0] if args else Path(__file__).resolve().parents[1])
    n = int(args[1]) if len(args) > 1 else 10
    for length, name, where in all_functions(root)[:n]:
        print(f"{length:5d}  {name}  ({where})")


if __name__ == "__main__":
    main()
