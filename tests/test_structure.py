"""The layout's rules, checked so that they stay true: short functions, no `nonlocal`, one owner of the
run directory's file names, imports that point one way."""

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

PACKAGE = ROOT / "transformer"
MAX_FUNCTION_LINES = 50  # the body a reader can hold in their head; split anything longer


def _modules() -> list:
    return sorted(PACKAGE.rglob("*.py"))


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in _modules():
        for fn in _functions(ast.parse(path.read_text())):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({lines} lines)")
    assert not long, "split these functions:\n" + "\n".join(long)


def test_no_nonlocal_state():
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Nonlocal)
    ]
    assert not found, "state shared by closures belongs in a class: " + ", ".join(found)


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "events.jsonl"])
def test_only_rundir_spells_the_run_directory_file_names(name):
    spelled = [p.relative_to(ROOT).as_posix() for p in _modules() if name in p.read_text()]
    assert spelled == ["transformer/rundir.py"]


@pytest.mark.parametrize(
    ("module", "must_not_import"),
    [
        ("transformer.report.plots", "transformer.report.render"),  # rendering uses plots, never the reverse
        ("transformer.report", "transformer.report.plots"),  # statistics need no matplotlib
        ("transformer.sweep", "transformer.report"),  # a sweep runs members; reading them is the report's
        ("transformer.config", "transformer.config_loader"),  # the schema knows nothing of YAML files
        ("transformer.train.trainer", "transformer.train.loop"),  # one step knows nothing of the host loop
    ],
)
def test_imports_point_one_way(module, must_not_import):
    code = f"import sys, {module}; print({must_not_import!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"importing {module} imports {must_not_import}"
