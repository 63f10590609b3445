"""Imports run one way: model_repository -> python_backends (the runtime) <- builders (build time).

The runtime (every module under python_backends/, the kept model.py files and the template
models that builders copy into the repository) never imports the build side (builders), the
user client (client) or the benchmarks (bench), not even lazily inside a function.
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
