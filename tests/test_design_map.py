"""docs/design.md's module map names every module of ``capricorn_jax/_src``.

The map's "Every module of `_src`, by folder" list has one line per folder:
``- `folder/`: `module` (what it is), ...``. The test reads the folders and
module names from the page and from the tree and asserts they are the same,
both ways, so a module added, moved or deleted without its line fails here.
"""

import re
from pathlib import Path

from tests.helpers import ROOT

SRC = ROOT / "capricorn_jax" / "_src"
DESIGN = ROOT / "docs" / "design.md"
LINE = re.compile(r"^- `([a-z_/]+)/`: (.*)$")
NAME = re.compile(r"`([a-z_0-9]+)`")


def map_of_page(text: str) -> dict[str, set[str]]:
    """{folder: module names} of the page's module list; a folder twice is an error."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        folder = m.group(1)
        assert folder not in out, f"folder {folder}/ listed twice"
        # Names in parentheses are descriptions (class names, flags): drop them.
        names = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", m.group(2))
        out[folder] = set(NAME.findall(names))
    return out


def map_of_tree(src: Path) -> dict[str, set[str]]:
    """{folder: module names} of every folder of ``src`` with a module."""
    out: dict[str, set[str]] = {}
    for path in src.rglob("*.py"):
        if path.name == "__init__.py" or "__pycache__" in path.parts:
            continue
        out.setdefault(path.parent.relative_to(src).as_posix(), set()).add(path.stem)
    return out


def test_the_design_page_names_every_module_of_the_library():
    page, tree = map_of_page(DESIGN.read_text()), map_of_tree(SRC)
    assert sorted(page) == sorted(tree), "folders: page vs tree"
    for folder in tree:
        missing, stale = tree[folder] - page[folder], page[folder] - tree[folder]
        assert not missing and not stale, (f"{folder}/: not on the page {sorted(missing)}, "
                                           f"on the page but not in the tree {sorted(stale)}")


def test_the_map_check_sees_a_module_missing_and_a_stale_name(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.py").write_text("")
    (tmp_path / "a" / "two.py").write_text("")
    page = map_of_page("- `a/`: `one` (the `Two` class, `x` (y)), `gone` (old)\n")
    assert page == {"a": {"one", "gone"}}
    assert map_of_tree(tmp_path) == {"a": {"one", "two"}}
