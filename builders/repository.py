"""Write the Triton model repository for a target (``cpu`` or ``gpu``).

One description per target (:data:`TARGETS`) is the single source of truth: each
model's config.pbtxt is rendered from ``builders/templates/<model>.pbtxt`` and any
unfilled placeholder fails the build. The generated files are git-ignored.
"""

from __future__ import annotations

import argparse
import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"


@dataclass(frozen=True)
class Target:
    name: str
    instance_kind: str
    # vLLM engine args shared by every vLLM-backed model of the target ("model" is added).
    engine_args: dict[str, Any]
    # Process environment for vLLM engines (config.pbtxt parameters, set before start).
    vllm_env: dict[str, str]
    # Request limits of the user-facing models.
    limits: dict[str, int] = field(
        default_factory=lambda: {
            "max_images": 4,
            "max_image_bytes": 20 << 20,
            "max_image_pixels": 4096 * 4096,
            "max_tokens_limit": 2048,
        }
    )


TARGETS: dict[str, Target] = {
    "cpu": Target(
        name="cpu",
        instance_kind="KIND_CPU",
        engine_args={
            "dtype": "float32",
            "max_model_len": 4096,
            "max_num_seqs": 32,
            "limit_mm_per_prompt": {"image": 4},
            # torch.compile costs minutes of start-up on 2 cores for no gain on a tiny model.
            "enforce_eager": True,
            "seed": 0,
            "disable_log_stats": True,
        },
        vllm_env={
            # GiB of KV cache per engine; 1 is plenty for the tiny model and lets several
            # engines fit in 24 GiB.
            "VLLM_CPU_KVCACHE_SPACE": "1",
        },
    ),
    "gpu": Target(
        name="gpu",
        instance_kind="KIND_MODEL",
        engine_args={
            "dtype": "bfloat16",
            "max_model_len": 8192,
            "max_num_seqs": 64,
            "limit_mm_per_prompt": {"image": 4},
            "gpu_memory_utilization": 0.35,
            "seed": 0,
            "disable_log_stats": True,
        },
        vllm_env={},
    ),
}

_PLACEHOLDER = re.compile(r"\$\{?\w+\}?")


def render_template(template_name: str, values: dict[str, str]) -> str:
    """Fill ``${name}`` placeholders; a missing value or a leftover one is an error."""
    text = (TEMPLATES / template_name).read_text()
    try:
        rendered = string.Template(text).substitute(values)
    except KeyError as exc:
        raise ValueError(f"{template_name}: no value for placeholder {exc}") from None
    leftover = _PLACEHOLDER.findall(rendered)
    if leftover:
        raise ValueError(f"{template_name}: unfilled placeholders {leftover}")
    return rendered


def render_parameters(parameters: dict[str, Any]) -> str:
    entries = [
        f'  {{ key: "{key}" value: {{ string_value: {json.dumps(str(value))} }} }}'
        for key, value in sorted(parameters.items())
    ]
    return ",\n".join(entries)


def llm_files(target: Target, model_dir: Path) -> dict[str, str]:
    config = render_template(
        "llm.pbtxt",
        {
            "target": target.name,
            "instance_kind": target.instance_kind,
            "parameters": render_parameters({**target.limits, **target.vllm_env}),
        },
    )
    engine_args = {"model": str(model_dir.resolve()), **target.engine_args}
    return {
        "llm/config.pbtxt": config,
        "llm/1/engine_args.json": json.dumps(engine_args, indent=2, sort_keys=True) + "\n",
    }


def repository_files(target: Target, model_dir: Path) -> dict[str, str]:
    """Relative path -> content of every generated file for ``target``."""
    return llm_files(target, model_dir)


def write_repository(target_name: str, model_dir: Path, out: Path = DEFAULT_REPOSITORY) -> list[Path]:
    if target_name not in TARGETS:
        raise ValueError(f"unknown target {target_name!r}; choose one of {sorted(TARGETS)}")
    written = []
    for relative, content in repository_files(TARGETS[target_name], model_dir).items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != content:
            path.write_text(content)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=Path, default=DEFAULT_REPOSITORY)
    args = parser.parse_args(argv)
    for path in write_repository(args.target, args.model, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
