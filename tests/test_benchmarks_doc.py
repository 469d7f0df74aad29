"""docs/BENCHMARKS.md is the latest run of each benchmark, one section per script, short enough to read
(at most 400 lines, prose wrapped), and README.md's results table has one short row per benchmark,
each linking to a section that exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors() -> set[str]:
    return {_slug(line) for line in DOC.read_text().splitlines() if line.startswith("#")}


def test_slug_is_githubs():
    assert _slug("## bench_triton_gpu: the Triton kernel against dequantize + cuBLAS") == \
        "bench_triton_gpu-the-triton-kernel-against-dequantize--cublas"
    assert _slug("## count_launches.py: launches (a tool)") == "count_launchespy-launches-a-tool"


def test_benchmarks_doc_is_short_and_wrapped():
    lines = DOC.read_text().splitlines()
    assert len(lines) <= 400, f"docs/BENCHMARKS.md has {len(lines)} lines (at most 400)"
    long = [i + 1 for i, line in enumerate(lines)
            if len(line) > 110 and not line.startswith(("|", "    "))]  # tables and commands may be long
    assert not long, f"docs/BENCHMARKS.md: prose lines over 110 columns: {long}"


def test_every_bench_script_has_its_section():
    headings = [line for line in DOC.read_text().splitlines() if line.startswith("## ")]
    for script in sorted((ROOT / "scripts").glob("bench_*.py")):
        assert any(h.startswith(f"## {script.stem}:") for h in headings), f"no '## {script.stem}:' section"


def test_readme_results_rows_are_short_and_link_to_sections():
    readme = ROOT / "README.md"
    text = readme.read_text()
    section = text[text.index("## Results"):text.index("\n## ", text.index("## Results") + 1)]
    rows = [r for r in section.splitlines() if r.startswith("| [")]
    assert len(rows) >= len(list((ROOT / "scripts").glob("bench_*.py")))
    anchors = _anchors()
    for row in rows:
        target = re.search(r"\]\(docs/BENCHMARKS\.md#([^)]+)\)", row)
        assert target, f"README results row without a link to its section: {row}"
        assert target.group(1) in anchors, f"README links to a section that does not exist: #{target.group(1)}"
        figure = row.split("|")[2]
        assert len(figure.strip()) <= 80, f"README results row is long: {figure.strip()}"
