"""Code that defers a measurement to the docs ("docs/performance.md#<section>") names a
section that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/performance.md",)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading (lower case, punctuation dropped, spaces to -)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_performance_anchor_in_the_code_exists():
    anchors = {_anchor(line.lstrip("#")) for doc in DOCS if (ROOT / doc).is_file()
               for line in (ROOT / doc).read_text().splitlines() if line.startswith("#")}
    cited = {}
    for pkg in ("engine", "kvserve_kernels", "server", "bench"):
        for path in (ROOT / pkg).rglob("*.py"):
            for name in re.findall(r"docs/performance\.md#([\w-]+)", path.read_text()):
                cited.setdefault(name, path.relative_to(ROOT).as_posix())
    assert cited, "the scan found no reference at all"
    missing = {name: where for name, where in cited.items() if name not in anchors}
    assert not missing, f"sections missing from {' or '.join(DOCS)}: {missing}"
