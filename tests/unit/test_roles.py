"""Server roles: the models each role serves, the repository written per role (with its kept model
code), the tritonserver flags that load exactly those models, and the launcher's --role / --node-id."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import launcher
from builders.repository import TARGETS, CachePolicy, write_repository
from builders.roles import load_model_args, role_models
from builders.tritonserver import REPO_ROOT
from python_backends import contract


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_each_role_serves_its_models(target: str) -> None:
    description = TARGETS[target]
    encoder = role_models(description, "encoder")
    pd = role_models(description, "pd")
    assert set(encoder) == {*description.encode.models, "encoder_0", "encoder_1"}
    assert {"preprocess", "vit_encoder", "encode"} <= set(encoder)
    assert ("vit_positions" in encoder) == (target == "gpu")
    assert set(pd) == {"epd", "prefill", "decode", "llm"}
    assert not set(encoder) & set(pd)
    # ``all`` is today's single server: both roles plus the static ensemble, which needs both sides.
    assert role_models(description, "all") == description.models
    assert set(description.models) - set(encoder) - set(pd) == {"ensemble"}


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown role 'decoder'"):
        role_models(TARGETS["cpu"], "decoder")  # type: ignore[arg-type]


def test_role_servers_load_exactly_their_models() -> None:
    cpu = TARGETS["cpu"]
    assert load_model_args(cpu, "all") == ()
    args = load_model_args(cpu, "encoder")
    assert args[0] == "--model-control-mode=explicit"
    assert sorted(arg.removeprefix("--load-model=") for arg in args[1:]) == sorted(role_models(cpu, "encoder"))


def _configs(out: Path) -> set[str]:
    return {p.parent.name for p in out.glob("*/config.pbtxt")}


def test_repository_per_role_and_switching_roles(tmp_path: Path, model_dir: Path, fast_build: None) -> None:
    out, stamps = tmp_path / "repo", tmp_path / "stamps"
    kept = REPO_ROOT / "model_repository"

    def same_code(model: str) -> bool:
        return (out / model / "1" / "model.py").read_bytes() == (kept / model / "1" / "model.py").read_bytes()

    write_repository("cpu", model_dir, out, stamps, role="encoder")  # an empty folder: the role's code copied
    assert _configs(out) == set(role_models(TARGETS["cpu"], "encoder"))
    assert all(same_code(model) for model in ("preprocess", "vit_encoder", "encoder_0"))
    assert not (out / "epd" / "1" / "model.py").exists()
    assert (out / "encoder_1" / "1" / "model.py").read_bytes() == (kept / "encoder_0" / "1" / "model.py").read_bytes()

    write_repository("cpu", model_dir, out, stamps, role="pd")
    assert _configs(out) == {"epd", "prefill", "decode", "llm"}
    assert all(same_code(model) for model in ("epd", "prefill", "decode", "llm"))
    assert not (out / "encoder_1" / "1" / "model.py").exists()  # the other role's generated files go
    # epd keys images by the encoder's digest, so the artefact stays; kept model code is never removed.
    assert (out / "vit_encoder" / "1" / contract.ONNX_FILE).is_file() and same_code("encoder_0")

    write_repository("cpu", model_dir, out, stamps)  # back to one server
    assert _configs(out) == set(TARGETS["cpu"].models)


def test_launcher_role_and_node_id_reach_the_configs(tmp_path: Path, model_dir: Path, fast_build: None) -> None:
    args = launcher.parse_args(["--role", "pd", "--node-id", "node-b", "--cache-path", "/dev/shm/b-store"])
    assert args.role == "pd"
    policy = launcher.cache_policy(args)
    assert policy == CachePolicy(path="/dev/shm/b-store", node_id="node-b")
    out = tmp_path / "repo"
    write_repository("cpu", model_dir, out, tmp_path / "stamps", cache=policy, role=args.role)
    epd = (out / "epd" / "config.pbtxt").read_text()
    assert 'key: "node_id"' in epd and 'string_value: "node-b"' in epd
    write_repository("cpu", model_dir, out, tmp_path / "stamps", cache=policy, role="pd", remote_encoders="e:8001")
    epd = (out / "epd" / "config.pbtxt").read_text()
    # A pd server with remote encoders runs no colocated engine: every image goes to the encoders.
    assert 'string_value: "e:8001"' in epd and 'string_value: "disaggregated"' in epd
    assert launcher.cache_policy(launcher.parse_args([])) is None  # defaults: the target's own policy
    assert launcher.parse_args([]).role == "all"
    with pytest.raises(SystemExit):
        launcher.parse_args(["--role", "decoder"])
