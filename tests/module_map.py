"""The module map of docs/architecture.md, generated from the package's module docstrings.

    python tests/module_map.py          # rewrite the map in docs/architecture.md
    python tests/module_map.py --check  # exit 1 when the committed map is not the generated one

Each module of `turnsight_jax/` is one row: its path and the first paragraph of its docstring (the
first sentence when that paragraph runs long), grouped by folder. The map sits between two marker
lines of docs/architecture.md; tests/test_module_map.py fails when a module is added, removed or
re-described without the map being regenerated, so the map cannot drift from the code.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "turnsight_jax"
DOC = REPO / "docs" / "architecture.md"
BEGIN = "<!-- module map: generated from the module docstrings by `python tests/module_map.py`; do not edit by hand -->"
END = "<!-- end of the generated module map -->"
LONG = 240  # characters: a longer first paragraph is cut to its first sentence


def summary(path: pathlib.Path) -> str:
    """The first paragraph of a module's docstring on one line ('' when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    if len(text) > LONG:
        sentence = re.match(r"(.+?[.:])(\s|$)", text)
        text = sentence.group(1) if sentence else text
    return text.replace("|", "\\|")


def modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def generate() -> str:
    """The map's markdown: one table per folder, the package's top level first."""
    folders: dict[str, list[pathlib.Path]] = {}
    for path in modules():
        rel = path.relative_to(PACKAGE)
        folders.setdefault(rel.parent.as_posix() if rel.parent != pathlib.Path(".") else "", []).append(path)
    out = []
    for folder in sorted(folders, key=lambda f: (f != "", f)):
        out.append(f"### `turnsight_jax/{folder + '/' if folder else ''}`\n")
        out.append("| module | what it holds |")
        out.append("|---|---|")
        for path in folders[folder]:
            out.append(f"| `{path.relative_to(PACKAGE).as_posix()}` | {summary(path)} |")
        out.append("")
    return "\n".join(out)


def committed() -> str | None:
    text = DOC.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write() -> None:
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n\n{generate().rstrip()}\n\n{END}{tail}", encoding="utf-8")


def main(argv: list[str]) -> int:
    if "--check" in argv:
        if committed() != generate().rstrip("\n") + "\n":
            print(f"{DOC.relative_to(REPO)}: the module map is not the generated one; run python tests/module_map.py",
                  file=sys.stderr)
            return 1
        return 0
    write()
    print(f"wrote the module map of {len(modules())} modules to {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
