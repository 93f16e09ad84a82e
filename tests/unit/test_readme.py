"""The README is the front door: at most 400 lines, every relative link in it (and in the docs
it points to) names a file that exists, and every ``scripts/...`` command it names exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"(?<![\w-])(scripts/[\w./-]+)")


def relative_links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in doc.read_text().splitlines():
        if m := re.match(r"#+ (.*)", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_the_readme_is_at_most_400_lines():
    assert len(README.read_text().splitlines()) <= 400


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_exists(doc):
    missing = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        if not (doc.parent / path).exists():
            missing.append(target)
    assert missing == []


def test_every_anchor_of_the_readme_names_a_heading():
    text = README.read_text()
    wanted = {t[1:] for t in LINK.findall(text) if t.startswith("#")}
    assert wanted <= anchors(README)


def test_the_readme_points_to_every_doc():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert {d.resolve() for d in DOCS} <= linked


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_script_named_exists(doc):
    named = {n.rstrip(".") for n in SCRIPT.findall(doc.read_text())}
    if doc == README:
        assert named, "the README's commands name scripts/..."
    assert sorted(s for s in named if not (ROOT / s).exists()) == []


def test_every_deploy_file_and_test_the_readme_names_exists():
    named = {n.rstrip(".") for n in re.findall(r"(?<![\w/.-])((?:deploy|tests)/[\w./-]+)", README.read_text())}
    assert named
    assert sorted(s for s in named if not (ROOT / s).exists()) == []
