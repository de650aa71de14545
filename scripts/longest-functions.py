#!/usr/bin/env python3
"""The longest function definitions of the library folders: a brace counter over namespace-level definitions of
the .cpp and .cu files, signature lines included (member functions defined in a class body are not counted).
Usage: scripts/longest-functions.py [ROOT] [N]   (default: this checkout, 10)"""
import re
import sys
from pathlib import Path

LIBRARY = ("core", "backends", "artifact", "serve", "runtime", "io", "eval", "fit", "tools", "apps", "python/src")


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


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    found = []
    missing = [f for f in LIBRARY if not (root / f).is_dir()]
    if missing:  # a folder renamed or gone: the list above is stale
        sys.exit(f"longest-functions.py: no folder {', '.join(missing)} under {root}; update LIBRARY")
    for folder in LIBRARY:
        for p in sorted((root / folder).rglob("*")):
            if p.suffix in (".cpp", ".cu") and "emulation" not in p.parts:
                found += [(length, name, str(p.relative_to(root))) for length, name, _ in functions(p)]
    for length, name, where in sorted(found, reverse=True)[:n]:
        print(f"{length:5d}  {name}  ({where})")


if __name__ == "__main__":
    main()
