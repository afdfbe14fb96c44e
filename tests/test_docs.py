"""The docs stay true: the example outputs they show are what the programs print now
(docs/generate.py --check reruns them), and every relative link in README.md and docs/*.md
points to a file (and heading) that exists."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", path.read_text())
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_doc_outputs_are_current():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = CODE.sub("", FENCE.sub("", doc.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto: …
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)
