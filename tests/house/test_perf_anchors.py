"""Code that defers a measurement to the docs ("docs/performance.md#<section>" for today's
figures, "docs/decisions.md#<section>" for the measurements behind a choice) names a section
that exists in the page it names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/performance.md", "docs/decisions.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading (lower case, punctuation dropped, spaces to -)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_performance_anchor_in_the_code_exists():
    anchors = {doc: {_anchor(line.lstrip("#")) for line in (ROOT / doc).read_text().splitlines()
                     if line.startswith("#")} if (ROOT / doc).is_file() else set() for doc in DOCS}
    cited = {}
    for pkg in ("engine", "kvserve_kernels", "server", "loadgen"):
        for path in (ROOT / pkg).rglob("*.py"):
            for doc, name in re.findall(r"(docs/(?:performance|decisions)\.md)#([\w-]+)",
                                        path.read_text()):
                cited.setdefault(f"{doc}#{name}", path.relative_to(ROOT).as_posix())
    assert cited, "the scan found no reference at all"
    missing = {ref: where for ref, where in cited.items()
               if ref.split("#")[1] not in anchors[ref.split("#")[0]]}
    assert not missing, f"sections missing from the page cited: {missing}"
