"""Every relative link in README.md, BENCHMARKS.md and docs/*.md points at a file that exists (and,
for a link to a heading of a markdown file, at a heading that exists).

Links are `[text](target)` outside code blocks and inline code; http(s) and mailto links are not
checked (no network in CI). Anchors follow GitHub's rule: the heading in lower case, characters
other than letters, digits, spaces, hyphens and underscores dropped, spaces turned into hyphens.

Mutations tried (2026-12-03, then reverted):
1. README.md's link `docs/design.md` changed to `docs/desing.md`:
       AssertionError: broken links: README.md: docs/desing.md (no such file)
2. BENCHMARKS.md's anchor `#the-gpu-machine-the-numbers-come-from` changed to `#the-gpu-machine`:
       AssertionError: broken links: BENCHMARKS.md: docs/design.md#the-gpu-machine (no heading
       'the-gpu-machine' in docs/design.md)
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def broken_links(doc: Path) -> list:
    bad = []
    for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(
                f"{doc.relative_to(ROOT)}: {target} "
                f"(no heading '{anchor}' in {dest.relative_to(ROOT)})"
            )
    return bad


def test_the_documents_exist():
    # The README links into these; a rename must update the links, not silently drop a document.
    for name in ("design.md", "api.md", "configuration.md", "changelog.md", "testing.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_resolve(doc):
    bad = broken_links(doc)
    assert not bad, "broken links: " + "; ".join(bad)


def test_the_checker_sees_a_broken_link(tmp_path):
    # The checker itself: a missing file and a missing heading are reported, code is not read.
    (tmp_path / "a.md").write_text("# Title here\n", encoding="utf-8")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#title-here) [gone](nope.md) [bad anchor](a.md#other)\n"
        "`[not a link](nope2.md)`\n```\n[in code](nope3.md)\n```\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        bad = broken_links(doc)
    finally:
        ROOT = saved
    assert bad == ["b.md: nope.md (no such file)", "b.md: a.md#other (no heading 'other' in a.md)"]
