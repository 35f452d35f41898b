"""Every link in the README and docs/ to a file of the repository, and to a heading of it,
finds what it names: a section moved or renamed breaks a test, not a reader's click."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: ``[text](target)`` with a relative target; code spans are taken out first
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped (hyphens
    and underscores kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(document: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced code), numbered as GitHub
    numbers repeats (``name``, ``name-1``, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in document.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(document: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of the document's relative links, outside code."""
    out = []
    fenced = False
    for number, line in enumerate(document.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z]+:", target):
                out.append((number, target))
    return out


def broken_links(document: Path) -> list[str]:
    """Each relative link of ``document`` whose file or heading is missing, as
    ``file:line: target (why)``."""
    broken = []
    for number, target in links(document):
        path_part, _, anchor = target.partition("#")
        linked = (document.parent / path_part).resolve() if path_part else document
        where = f"{document.name}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no file {path_part})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{where} (no heading with anchor #{anchor} in {linked.name})")
    return broken


def test_the_anchor_of_a_heading_is_githubs():
    assert slug("Every plan at 100 Mbit/s (issue 27, 2026-11-29)") == (
        "every-plan-at-100-mbits-issue-27-2026-11-29"
    )
    assert slug('Automatic plans: `thinwire plan --model` and `parallelize(model, "auto")`') == (
        "automatic-plans-thinwire-plan---model-and-parallelizemodel-auto"
    )


def test_a_missing_heading_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nSee [it](#title), [gone](#gone) and `[code](#not-a-link)`.\n")
    assert anchors(page) == {"title"}
    assert [target for _, target in links(page)] == ["#title", "#gone"]
    assert broken_links(page) == ["page.md:3: #gone (no heading with anchor #gone in page.md)"]
    page.write_text("[there](page.md#title) [elsewhere](missing.md)\n# Title\n")
    assert broken_links(page) == ["page.md:1: missing.md (no file missing.md)"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_finds_its_file_and_heading(document):
    assert broken_links(document) == []
