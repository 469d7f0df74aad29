"""No function in the library is over 50 lines (docs/DESIGN.md, style): small functions, one job each."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flexsarathi", "offload", "policy_search", "quant")
MAX_LINES = 50
ALLOWED: set[str] = set()  # functions allowed over the limit (none)


def long_functions() -> dict[str, int]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        out[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    return out


def test_no_function_is_over_50_lines():
    too_long = {name: n for name, n in long_functions().items() if name not in ALLOWED}
    assert not too_long, f"functions over {MAX_LINES} lines: {too_long}"


def test_the_allow_list_names_only_functions_still_too_long():
    assert not set(ALLOWED) - set(long_functions())
