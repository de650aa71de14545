#!/usr/bin/env python3
"""Every path and symbol a document names in backticks exists: a path as a file or folder of the repository (a bare
file name anywhere in it), a C++ or Python identifier as a word of its sources. Prose, commands, options and names
of things a run makes (build/, k<K>/, ...) are not checked. And no document of the repository links outside it: a
Markdown link to a web address or to a path that leaves the repository (`../`), or a path named that leaves it, is
an error (a user's clone holds only the repository). Usage: doc_names.py [DOC ...] (default: docs/ARCHITECTURE.md
for the names, every tracked .md file for the links), or --self-test (a planted document). Exits 1 naming each
missing name and each outside link with its line."""
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_EXT = (".cpp", ".hpp", ".cu", ".h", ".py", ".sh", ".txt", ".cmake", ".toml", ".sbatch")
PATH_EXT = SOURCE_EXT + (".md", ".yaml", ".json", ".lock")
IDENT = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*::)*~?[A-Za-z_][A-Za-z0-9_]*(?:\(\))?$")
MADE_BY_RUNS = ("build/", "build-", "k<", "out/", "checkpoint/", "/tmp/", "$", "~")


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if (ROOT / p).exists()]


def main(docs, link_docs=None):
    files = tracked()
    paths = set(files)
    folders = {str(Path(p).parent) + "/" for p in files}
    folders |= {f.rstrip("/") for f in folders}
    names = {Path(p).name for p in files}
    words = set()
    for p in files:
        if (p.endswith(SOURCE_EXT) or "." not in Path(p).name) and (ROOT / p).resolve() != Path(__file__).resolve():
            try:
                words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", (ROOT / p).read_text(errors="replace")))
            except (IsADirectoryError, OSError):
                pass
    missing = []
    for doc in docs:
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            if line.startswith("```"):
                continue
            for tok in re.findall(r"`([^`\n]+)`", line):
                what = check(tok, paths, folders, names, words)
                if what:
                    missing.append(f"{doc}:{n}: `{tok}`: {what}")
    for m in missing:
        print("MISSING", m)
    checked = ", ".join(docs)
    print(f"{checked}: {'every named path and symbol exists' if not missing else f'{len(missing)} missing'}")
    outside = outside_links(link_docs if link_docs is not None else [p for p in files if p.endswith(".md")])
    for o in outside:
        print("LEAVES", o)
    print(f"links: {'none leaves the repository' if not outside else f'{len(outside)} leave the repository'}")
    return 1 if missing or outside else 0


LINK = re.compile(r"\]\(([^)\s]+)\)")


def outside_links(docs):
    """Each Markdown link, or backticked path, of `docs` that leaves the repository: doc:line: target."""
    out = []
    for doc in docs:
        path = ROOT / doc if not os.path.isabs(doc) else Path(doc)
        base = path.parent
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            targets = LINK.findall(line) + [t for t in re.findall(r"`([^`\n ]+)`", line) if t.startswith("../")]
            for t in targets:
                if re.match(r"^[a-z][a-z0-9+.-]*://", t) or t.startswith("mailto:"):
                    out.append(f"{doc}:{n}: {t}: a link outside the repository")
                elif not t.startswith("#"):
                    target = (base / t.split("#")[0]).resolve()
                    if os.path.isabs(doc):  # a planted document: judged as if it sat in docs/
                        target = (ROOT / "docs" / t.split("#")[0]).resolve()
                    if ROOT not in target.parents and target != ROOT:
                        out.append(f"{doc}:{n}: {t}: leaves the repository")
    return out


def check(tok, paths, folders, names, words):
    tok = tok.strip()
    if any(tok.startswith(p) for p in MADE_BY_RUNS) or " " in tok or "<" in tok or "*" in tok or "{" in tok:
        return None
    if re.fullmatch(r"\.[a-z]+", tok):
        return None  # an extension: `.cu`
    looks_like_path = "/" in tok or tok.endswith(PATH_EXT)
    if looks_like_path:
        if tok.startswith(("http", "-", "crosskv.", "../")) or "=" in tok or ":" in tok:  # ../: the links' check
            return None
        p = tok.lstrip("./")
        if p in paths or p in folders or p.rstrip("/") in folders:
            return None
        if any(q.startswith(p + ".") for q in paths):
            return None  # a module: `core/ridge` for core/ridge.hpp and .cpp
        if "/" not in p.rstrip("/") and p in names:
            return None
        if any(q.endswith("/" + p) or q.endswith("/" + p.rstrip("/")) for q in paths | folders):
            return None  # a path below a folder the prose already named (backends/cuda/ ... `emulation/`)
        return "no such file or folder"
    if IDENT.match(tok):
        last = tok.rstrip("()").split("::")[-1].lstrip("~")
        if last in words:
            return None
        return "no such symbol in the sources"
    return None


def self_test():
    """The checker catches planted names: a document naming two that exist and two that do not fails on those two."""
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write("`core/backend.hpp` and `ServingMapper` exist;\n`core/no_such_file.hpp` and `no_such_symbol_xyz()` do not.\n"
                "[the method](METHOD.md) is inside; [the spec](../../shared/SPEC.md), [a site](https://example.com) "
                "and `../../shared/seeds/` are not.\n")
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main([f.name], link_docs=[f.name])
        lines = [l for l in out.getvalue().splitlines() if l.startswith("MISSING")]
        leaves = [l for l in out.getvalue().splitlines() if l.startswith("LEAVES")]
        ok = rc == 1 and len(lines) == 2 and "no_such_file" in lines[0] and "no_such_symbol_xyz" in lines[1]
        ok = ok and len(leaves) == 3 and "SPEC.md" in leaves[0] and "example.com" in leaves[1] and "seeds" in leaves[2]
        print(out.getvalue(), end="")
        print("self-test:", "the planted names and outside links are caught" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(main(sys.argv[1:] or ["docs/ARCHITECTURE.md"]))
