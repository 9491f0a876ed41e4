"""The layout's rules, checked so that they stay true: short functions, no `nonlocal`, one owner of the
run directory's file names, one package per stage with a face, imports that point one way and never
in a loop, light callers kept light."""

import ast
import collections
import importlib
import re
import subprocess
import sys

import pytest
from conftest import ROOT

PACKAGE = ROOT / "transformer"
MAX_FUNCTION_LINES = 50  # the body a reader can hold in their head; split anything longer
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def _modules() -> list:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path) -> str:
    """The dotted module name of a file under the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _imports(path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of the package in `path`, those inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "transformer":
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "transformer"]
    return found


def _unit(module: str) -> str:
    """What the no-loop rule counts as one node: a subpackage whole, or a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path in _modules():
        here = _unit(_name(path))
        for module, names in _imports(path):
            targets = [f"{module}.{n}" for n in names] if module == "transformer" else [module]
            graph[here] |= {_unit(t) for t in targets} - {here, "transformer"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of `graph` as a path that returns to its start, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


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


def test_the_stages_are_the_subpackages_of_the_design():
    assert SUBPACKAGES == ["data", "eval", "io", "model", "report", "sweep", "train"]


def test_no_import_loop_between_packages():
    graph = _package_graph()
    assert "transformer.train" in graph["transformer.eval"]  # the graph sees imports (a loop needs edges)
    assert _cycle(graph) is None, "import loop: " + " -> ".join(_cycle(graph) or [])


def test_the_loop_finder_finds_a_loop():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_package_has_a_face_that_maps_its_modules(package):
    face = importlib.import_module(f"transformer.{package}")
    own = sorted(p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__")
    unmapped = [m for m in own if f"`{m}.py`" not in (face.__doc__ or "")]
    assert not unmapped, f"transformer/{package}/__init__.py's docstring does not map {unmapped}"
    assert face.__all__ and len(face.__all__) == len(set(face.__all__))
    for name in face.__all__:
        assert getattr(face, name) is not None


def test_other_packages_import_a_package_through_its_face():
    """Inside a package, modules import their siblings; from outside, only what its face exports."""
    faces = {p: set(importlib.import_module(f"transformer.{p}").__all__) for p in SUBPACKAGES}
    wrong = []
    for path in _modules():
        here = _unit(_name(path))
        for module, names in _imports(path):
            parts = module.split(".")
            if len(parts) < 2 or parts[1] not in faces or _unit(module) == here:
                continue
            if len(parts) > 2:
                wrong.append(f"{path.relative_to(ROOT)}: from {module} import ... (use transformer.{parts[1]})")
            wrong += [
                f"{path.relative_to(ROOT)}: {module}.{n} is not in its __all__"
                for n in names
                if n not in faces[parts[1]]
            ]
    assert not wrong, "\n".join(wrong)


def test_no_two_public_functions_or_classes_share_a_name():
    where = collections.defaultdict(list)
    for path in _modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where[node.name].append(path.relative_to(ROOT).as_posix())
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"one name, several meanings: {shared}"


def test_the_readme_module_map_names_every_module():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Module map") : readme.index("## Where each variant lives")]
    named = set(re.findall(r"`([\w/]+\.py)`", table))
    missing = [
        path.relative_to(PACKAGE).as_posix()
        for path in _modules()
        if path.name != "__init__.py" and path.relative_to(PACKAGE).as_posix() not in named
    ]
    assert not missing, f"README.md's module map leaves out {missing}"


def _imported_by(modules: list[str]) -> set[str]:
    code = f"import sys; import {', '.join(modules)}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(out.stdout.split())


def _under(package: str) -> list[str]:
    return [_name(p) for p in sorted((PACKAGE / package).glob("*.py"))]


@pytest.mark.parametrize(
    ("modules", "heavy"),
    [
        (_under("sweep"), "jax"),  # a sweep's parent runs no model: its members own the accelerator
        (["transformer.report", "transformer.report.stats"], "matplotlib"),  # statistics need no plotting
        (["transformer.train", "transformer.train.signals"], "jax"),  # the lazy face the sweep reads signals through
        (["transformer.cli", "transformer.data"], "jax"),  # argument and config mistakes answer before JAX starts
    ],
)
def test_light_callers_stay_light(modules, heavy):
    assert heavy not in _imported_by(modules), f"importing {modules} imports {heavy}"


@pytest.mark.parametrize(
    ("module", "must_not_import"),
    [
        ("transformer.report.plots", "transformer.report.render"),  # rendering uses plots, never the reverse
        ("transformer.report.stats", "transformer.report.plots"),  # statistics need no matplotlib
        ("transformer.sweep", "transformer.report"),  # a sweep runs members; reading them is the report's
        ("transformer.config", "transformer.config_loader"),  # the schema knows nothing of YAML files
        ("transformer.train.trainer", "transformer.train.loop"),  # one step knows nothing of the host loop
        ("transformer.io.hf", "transformer.eval.evaluate"),  # the format knows nothing of the commands that use it
    ],
)
def test_imports_point_one_way(module, must_not_import):
    assert must_not_import not in _imported_by([module]), f"importing {module} imports {must_not_import}"
