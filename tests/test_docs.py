"""The README and the docs/ pages: the README stays short, and every relative link on them leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A markdown link or image: [text](target) or ![alt](target); the text may wrap onto the next line.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its fenced code blocks and inline code, where brackets and '#' lines are not links or
    headings."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, and -1, -2,
    ... on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_the_readme_is_under_150_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines (fix: move a section to a docs/ page and link it)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...: not this repository's
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: " + "; ".join(broken)
