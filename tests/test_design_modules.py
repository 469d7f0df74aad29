"""docs/DESIGN.md's "Modules" section names every module of the library and every benchmark script
(its one job), and names nothing that no longer exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flexsarathi", "offload", "policy_search", "quant")


def _modules_section() -> str:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    start = text.index("## Modules")
    return text[start:text.index("\n## ", start + 1)]


def _named(section: str) -> set[str]:
    """Paths named in the table's first column; `a/b.py`, `c.py` names a/b.py and a/c.py."""
    named = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        cells = re.findall(r"`([^`]+)`", row.split("|")[1])
        folder = cells[0].rsplit("/", 1)[0] if "/" in cells[0] else ""
        for cell in cells:
            named.add(cell if "/" in cell else f"{folder}/{cell}")
    return named


def _library_files() -> set[str]:
    files = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py":
                continue  # a package's __init__ re-exports; its modules have the jobs
            files.add(relative)
    files |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "scripts").glob("bench_*.py")}
    return files


def test_every_module_is_named_in_design():
    named = _named(_modules_section())
    missing = sorted(_library_files() - named)
    assert not missing, f"docs/DESIGN.md 'Modules' does not name: {missing}"


def test_design_names_only_existing_modules():
    named = _named(_modules_section())
    gone = sorted(path for path in named if not (ROOT / path).exists())
    assert not gone, f"docs/DESIGN.md 'Modules' names modules that do not exist: {gone}"
