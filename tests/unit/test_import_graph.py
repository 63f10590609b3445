"""Imports run one way: model_repository -> python_backends (the runtime) <- builders (build time).

- The runtime (every module under python_backends/, the kept model.py files and the template
  model that builders write for the gpu target) never imports the build side (builders), the
  user client (client) or the benchmarks (bench), not even lazily inside a function.
- Only python_backends/triton_edge/ imports Triton's ``triton_python_backend_utils``: everything
  else is plain Python, tested without a server.
- The contract (python_backends/contract/) imports nothing of the runtime but itself.
- bench (shipped) never imports tests (not shipped), and no test helper imports bench: only
  the tests of bench's own code do.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_AND_CLIENT_SIDE = ("builders", "client", "bench")


def runtime_modules() -> list[Path]:
    return sorted(
        [
            *REPO_ROOT.glob("python_backends/**/*.py"),
            *REPO_ROOT.glob("model_repository/*/1/model.py"),
            *REPO_ROOT.glob("builders/templates/*.py"),
        ]
    )


def imported_modules(source: str, package: str) -> Iterator[tuple[str, int]]:
    """Every module ``source`` imports (top-level or inside functions, or by importlib);
    ``package``: the module's package, for relative imports."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join([*base, *([node.module] if node.module else [])]), node.lineno
            elif node.module:
                yield node.module, node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield node.args[0].value, node.lineno


def test_the_runtime_never_imports_the_build_or_client_side() -> None:
    modules = runtime_modules()
    assert len(modules) > 20 and any(p.name == "model.py" for p in modules)
    upward = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
        for path in modules
        for name, line in imported_modules(path.read_text(), ".".join(path.relative_to(REPO_ROOT).parts[:-1]))
        if name.split(".")[0] in BUILD_AND_CLIENT_SIDE
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    ("code", "found"),
    [
        ("import builders.repository", "builders.repository"),
        ("def f():\n    from client.epd_client import GrpcClient", "client.epd_client"),
        ("import importlib\nimportlib.import_module('bench.cli')", "bench.cli"),
        ("from ..store import config", "python_backends.store"),
    ],
)
def test_the_check_sees_every_kind_of_import(code: str, found: str) -> None:
    assert found in {name for name, _ in imported_modules(code, "python_backends.pd")}


def project_modules(*roots: str) -> list[Path]:
    paths = (path for root in roots for path in (REPO_ROOT / root).rglob("*.py"))
    return sorted(path for path in paths if "__pycache__" not in path.parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    package = ".".join(path.relative_to(REPO_ROOT).parts[:-1])
    return list(imported_modules(path.read_text(), package))


def test_only_the_triton_edge_imports_triton_python_backend_utils() -> None:
    edge = REPO_ROOT / "python_backends" / "triton_edge"
    modules = project_modules("python_backends", "model_repository", "builders", "client", "bench")
    assert any(edge in path.parents for path in modules)
    outside = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in modules
        if edge not in path.parents
        for name, line in imports_of(path)
        if name.split(".")[0] == "triton_python_backend_utils"
    ]
    assert not outside, "import Triton through python_backends.triton_edge, not here:\n" + "\n".join(outside)


def test_the_contract_imports_nothing_of_the_runtime() -> None:
    modules = project_modules("python_backends/contract")
    assert len(modules) >= 3
    runtime = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
        for path in modules
        for name, line in imports_of(path)
        if name.startswith("python_backends") and not name.startswith("python_backends.contract")
        and name != "python_backends"
    ]
    assert not runtime, "\n".join(runtime)


def test_bench_and_tests_do_not_lean_on_each_other() -> None:
    bench_to_tests = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
        for path in project_modules("bench")
        for name, line in imports_of(path)
        if name.split(".")[0] == "tests"
    ]
    helpers = [
        path for path in project_modules("tests") if not path.name.startswith("test_") and path.name != "conftest.py"
    ]
    helpers_to_bench = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
        for path in helpers
        for name, line in imports_of(path)
        if name.split(".")[0] == "bench"
    ]
    assert not bench_to_tests and not helpers_to_bench, "\n".join(bench_to_tests + helpers_to_bench)
