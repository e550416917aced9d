"""The docs' shape: a README a newcomer reads in one sitting, tables that stay tables, and links from the
pages outside the site (README.md, BENCHMARKS.md) that reach a page and a heading. Links inside docs/ are
checked by ``mkdocs build --strict``, a step of scripts/test.sh."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
README_LINES = 200
CELL_CHARS = 200
TABLED = sorted(
    [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: str(p.relative_to(ROOT)),
)
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
FENCED = re.compile(r"^ *```.*?^ *```", re.M | re.S)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return FENCED.sub("", page.read_text())


def cells(row: str) -> list[str]:
    """A table row's cells; a ``|`` inside backticks belongs to its cell."""
    parts, cell, code = [], "", False
    for ch in row.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            parts.append(cell)
            cell = ""
        else:
            cell += ch
    return [*parts, cell]


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+?)\s*$", prose(page), re.M)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in headings}


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines: move the detail into a docs/ page"


@pytest.mark.parametrize("page", TABLED, ids=page_id)
def test_table_cells_are_short(page: Path) -> None:
    """Prose belongs below a table, not in its cells."""
    long = [
        (n, len(cell))
        for n, line in enumerate(prose(page).splitlines(), 1)
        if line.lstrip().startswith("|")
        for cell in cells(line)
        if len(cell.strip()) > CELL_CHARS
    ]
    assert not long, f"{page_id(page)}: cells over {CELL_CHARS} characters (line, length): {long}"


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "BENCHMARKS.md"], ids=page_id)
def test_links_outside_the_site_reach_a_page_and_heading(page: Path) -> None:
    checked = 0
    for match in LINK.finditer(prose(page)):
        target = match["target"]
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.is_file(), f"{page_id(page)}: {target} names no file"
        if anchor:
            assert anchor in anchors(file), f"{page_id(page)}: {target}: no such heading in {file.name}"
        checked += 1
    assert checked, f"{page_id(page)} links to nothing: the link pattern is broken"
