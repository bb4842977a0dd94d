"""The written pages stay tied to the code: every technique the registry lists has its page, the
README stays a front page, and nothing in the README or the docs points outside the repository.

Reads the files only: it needs neither Sphinx nor a build (``make docs`` builds, warnings as errors)."""

from __future__ import annotations

import re
from pathlib import Path

from moeflow.parallel.registry import FEATURES, SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TECHNIQUES = DOCS / "guides" / "techniques"
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of a Markdown link or image


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _table_rows(page: Path) -> dict[str, str]:
    """First cell (its code span) -> the whole row, for every table row of ``page``."""
    rows = {}
    for line in page.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and (name := re.fullmatch(r"`([^`]+)`", cells[0])):
            rows[name.group(1)] = line
    return rows


def test_every_registered_technique_has_a_row_and_a_page() -> None:
    rows = _table_rows(TECHNIQUES / "index.md")
    names = [spec.name for spec in SCHEDULES] + [spec.name for spec in FEATURES]
    missing = [name for name in names if name not in rows]
    assert not missing, f"docs/guides/techniques/index.md has no table row for {missing}"
    for name in names:
        targets = [target.split("#")[0] for target in LINK.findall(rows[name]) if ".md" in target]
        assert targets, f"the row of {name!r} links to no technique page"
        for target in targets:
            assert (TECHNIQUES / target).is_file(), f"the row of {name!r} links to a missing page {target}"


def test_every_technique_page_is_in_the_index_toctree() -> None:
    index = (TECHNIQUES / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index, re.DOTALL)
    assert toctree is not None
    listed = {line.strip() for line in toctree.group(1).splitlines() if line.strip() and not line.startswith(":")}
    pages_here = {page.stem for page in TECHNIQUES.glob("*.md") if page.name != "index.md"}
    assert pages_here == listed


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for command in ("make run", "make test", "make docs", "docs/index.md"):
        assert command in text


def test_nothing_points_outside_the_repository() -> None:
    outside = []
    for page in pages():
        text = page.read_text()
        if "../shared" in text:
            outside.append(f"{page.relative_to(ROOT)}: ../shared")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address (a citation) or an anchor on the same page
            resolved = (page.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                outside.append(f"{page.relative_to(ROOT)}: {target}")
    assert not outside, f"links that leave the repository or lead nowhere: {outside}"
