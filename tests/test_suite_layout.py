"""The suite's own layout: test modules share code through helpers modules, never through each other
(a test module imported elsewhere cannot be selected, marked or moved on its own)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_test_module_imports_another():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        tests = sorted(m for m in _imported_modules(path)
                       if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_"))
        if tests:
            offenders[str(path.relative_to(TESTS.parent))] = tests
    assert offenders == {}
