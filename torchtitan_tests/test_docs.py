"""The documentation's own links: every relative link in README.md, docs/ and benchmarks/ reaches a file
that exists, and every #anchor a heading of that file (GitHub's slug: lower case, punctuation but '-' and
'_' dropped, spaces as '-')."""

import re

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md",
        ROOT / "benchmarks" / "results" / "README.md"]


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _prose(text), flags=re.M)}


def _prose(text: str) -> str:
    """The text without its fenced code blocks (a '#' there is a comment, a '](' no link)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def links(path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", _prose(path.read_text()))
            if not m.group(1).startswith(("http://", "https://", "mailto:"))]


def test_slug_is_githubs():
    assert slug("Presets and the best configuration at 32 x 2048 tokens a step (1 x H100)") == \
        "presets-and-the-best-configuration-at-32-x-2048-tokens-a-step-1-x-h100"
    assert slug("`parallelism.fsdp_copy_engine_all_gather`, auto") == "parallelismfsdp_copy_engine_all_gather-auto"


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for link in links(doc):
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such heading)")
    assert broken == []
