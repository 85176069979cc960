"""The tree stays easy to read: no module of the package over 450 lines, no function over 80, and no Python file of
the project that edits ``sys.path`` (scripts and tests import the installed package; pytest.ini puts
``benchmarks`` on the path)."""

import ast

from helpers import ROOT

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _python_files(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_modules_and_functions_stay_short():
    long = []
    for path in _python_files("dgpipe"):
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_no_file_edits_sys_path():
    edits = []
    for path in [*_python_files("dgpipe", "tests", "benchmarks", "bandwidth"), *sorted(ROOT.glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if isinstance(target, ast.Attribute) and target.attr == "path" and \
                    isinstance(target.value, ast.Name) and target.value.id == "sys":
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert edits == []
