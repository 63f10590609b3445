"""Closed doors on a real ``triton-epd-serve`` (issue 51): Triton's admin APIs behind the admin key,
an encoder-role server's inference behind the peer key, and a PD server's client code that sends it.

One encoder-role launcher (no vLLM engine: ready in seconds) with ``--admin-key-file`` and
``--peer-key-file``; every closed category is called over HTTP and gRPC without a key, with a wrong
one and with the right one. The PD side is the real ``RemoteEncoders`` of a pd server, run in this
process with the peer key's file in its environment, as the launcher hands it to epd's stub.
(An ``all``-role server's model-config category under the admin key: tests/server/test_launcher.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builders.access import ADMIN_HEADER, grpc_header
from builders.tritonserver import REPO_ROOT, Ports
from python_backends.scaleout import wire
from python_backends.scaleout.endpoints import StaticEndpoints
from python_backends.scaleout.remote import RemoteEncoders
from python_backends.store import EmbeddingStore, KeyConfig, StoreConfig
from tests.images import synthetic_image
from tests.server.conftest import LAUNCHER_REPOSITORY
from tests.server.test_launcher_death import Launcher, launch

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

PEER_HEADER = wire.PEER_HEADER
ENCODER = wire.ENCODER_MODEL
# HTTP method and path of one call per category the encoder server closes; body for POSTs.
ADMIN_CALLS = {
    "model-repository": ("POST", "/v2/repository/index", b"{}"),
    "shared-memory": ("GET", "/v2/systemsharedmemory/status", None),
    "logging": ("GET", "/v2/logging", None),
    "trace": ("GET", "/v2/trace/setting", None),
}
PEER_CALLS = {
    "model-config": ("GET", f"/v2/models/{ENCODER}/config", None),
    # Every model's, the ONNX encoder's too (encoder_0 is decoupled: gRPC only). A request the model
    # refuses (no inputs): the door opened and the model answered.
    "inference": ("POST", "/v2/models/vit_encoder/infer", json.dumps({"inputs": []}).encode()),
}
OPEN_CALLS = {
    "health": ("GET", "/v2/health/ready", None),
    "metadata": ("GET", f"/v2/models/{ENCODER}", None),
    "statistics": ("GET", f"/v2/models/{ENCODER}/stats", None),
}


def _key_file(path: Path, key: str) -> Path:
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def encoder(model_dir: Path, node_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    keys = tmp_path_factory.mktemp("access-keys")
    admin_file = keys / "admin-key"  # missing: the launcher generates it
    peer_file = _key_file(keys / "peer-key", "peer-key-for-the-access-test-0123456789")
    launcher = launch("encoder", Ports.free(), None, node_dir, "access",
                      extra=["--admin-key-file", str(admin_file), "--peer-key-file", str(peer_file)])  # fmt: skip
    try:
        launcher.wait_serving()
        yield {"launcher": launcher, "admin_file": admin_file, "peer_file": peer_file}
    finally:
        launcher.process.terminate()
        launcher.process.wait(timeout=120)


def _http(launcher: Launcher, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{launcher.ports.http}{path}", data=body, method=method,
                                     headers={"Content-Type": "application/json", **headers})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_generated_admin_key_is_owner_only_printed_once_and_never_on_the_command_line(encoder) -> None:
    launcher, admin_file = encoder["launcher"], encoder["admin_file"]
    key = admin_file.read_text().strip()
    assert stat.S_IMODE(admin_file.stat().st_mode) == 0o600 and len(key) >= 32
    output = "".join(launcher.output)
    assert output.count(key) == 1 and f"admin key (shown once): {key}" in output and str(admin_file) in output
    starting = next(line for line in launcher.output if line.startswith("starting: "))
    peer_key = encoder["peer_file"].read_text().strip()
    assert key not in starting and peer_key not in starting and "--http-restricted-api=" in starting


@pytest.mark.parametrize("category", [*ADMIN_CALLS, *PEER_CALLS])
def test_a_closed_category_answers_403_without_its_key_or_with_a_wrong_one_and_works_with_it(encoder, category):
    launcher = encoder["launcher"]
    header, key = ((ADMIN_HEADER, encoder["admin_file"].read_text().strip()) if category in ADMIN_CALLS
                   else (PEER_HEADER, encoder["peer_file"].read_text().strip()))  # fmt: skip
    method, path, body = {**ADMIN_CALLS, **PEER_CALLS}[category]
    for headers in ({}, {header: key + "x"}, {header: key[:-1]}, {"Authorization": f"Bearer {key}"}):
        status, text = _http(launcher, method, path, body, headers)
        assert status == 403 and f"expecting header '{header}'" in text, (headers, status, text)
    status, text = _http(launcher, method, path, body, {header: key})
    assert status == (400 if category == "inference" else 200), (status, text)


@pytest.mark.parametrize("category", OPEN_CALLS)
def test_health_metadata_and_statistics_stay_open(encoder, category) -> None:
    assert _http(encoder["launcher"], *OPEN_CALLS[category], {})[0] == 200


def test_grpc_closes_the_same_categories(encoder) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    launcher = encoder["launcher"]
    admin = {grpc_header(ADMIN_HEADER): encoder["admin_file"].read_text().strip()}
    peer = {grpc_header(PEER_HEADER): encoder["peer_file"].read_text().strip()}
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launcher.ports.grpc}")
    calls = {
        "model-repository": (lambda h: client.get_model_repository_index(headers=h), admin),
        "shared-memory": (lambda h: client.get_system_shared_memory_status(headers=h), admin),
        "logging": (lambda h: client.get_log_settings(headers=h), admin),
        "trace": (lambda h: client.get_trace_settings(headers=h), admin),
        "model-config": (lambda h: client.get_model_config(ENCODER, headers=h), peer),
    }
    try:
        for name, (call, key) in calls.items():
            with pytest.raises(InferenceServerException, match="restricted") as refused:
                call(None)
            assert refused.value.status() == "StatusCode.UNAVAILABLE", name
            wrong = {header: value + "x" for header, value in key.items()}
            with pytest.raises(InferenceServerException, match="restricted"):
                call(wrong)
            call(key)  # opens with its own key
        assert client.is_server_ready() and client.get_model_metadata(ENCODER)
    finally:
        client.close()


def _remote(launcher: Launcher, tmp_path: Path) -> tuple[RemoteEncoders, EmbeddingStore]:
    """A pd server's remote encoders (another node: embeddings come by value) in this process."""
    config = (LAUNCHER_REPOSITORY / f"{ENCODER}/config.pbtxt").read_text()
    preprocessor = Path(config.split('key: "preprocessor_config"')[1].split('string_value: "')[1].split('"')[0])
    keys = KeyConfig.from_files(preprocessor, LAUNCHER_REPOSITORY / "vit_encoder" / "1" / "model.onnx")
    store = EmbeddingStore(StoreConfig(path=str(tmp_path / "store"), merge_size=2))
    address = f"127.0.0.1:{launcher.ports.grpc}"
    remote = RemoteEncoders(StaticEndpoints([address]), store, keys, node_id="access-pd", store_path="elsewhere",
                            merge_size=2, deadline_s=10.0)  # fmt: skip
    return remote, store


def _encode(remote: RemoteEncoders, image: bytes) -> tuple[bytes, bool]:
    async def run() -> tuple[bytes, bool]:
        try:
            await remote.refresh()
            return await remote.encode_reference(image, lease_owner=os.getpid())
        finally:
            await remote.close()

    return asyncio.run(run())


def test_a_pd_server_with_the_peer_key_encodes_through_the_encoder_and_one_without_is_refused(
    encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher, image = encoder["launcher"], synthetic_image(64, 48, seed=7)
    address = f"127.0.0.1:{launcher.ports.grpc}"

    monkeypatch.setenv(wire.PEER_KEY_FILE_ENV, str(encoder["peer_file"]))
    remote, store = _remote(launcher, tmp_path / "with-key")
    try:
        reference, _ = _encode(remote, image)
        assert reference and remote.stats.refused == {}
    finally:
        store.close()

    wrong = _key_file(tmp_path / "wrong", "a-wrong-peer-key-0123456789")
    for name, key_file in (("no-key", None), ("wrong-key", wrong)):
        if key_file is None:
            monkeypatch.delenv(wire.PEER_KEY_FILE_ENV)
        else:
            monkeypatch.setenv(wire.PEER_KEY_FILE_ENV, str(key_file))
        remote, store = _remote(launcher, tmp_path / name)
        try:
            with pytest.raises(Exception, match="no encoder server could encode the image") as refused:
                _encode(remote, image)
            assert f"{address}: refused" in str(refused.value) and "encoder servers' key" in str(refused.value)
            assert remote.stats.refused == {address: 1}, name  # the pd server's refused-encoder counter
        finally:
            store.close()

    # The encoder served on: the keyed pd side still encodes.
    monkeypatch.setenv(wire.PEER_KEY_FILE_ENV, str(encoder["peer_file"]))
    remote, store = _remote(launcher, tmp_path / "again")
    try:
        assert _encode(remote, image)[0]
    finally:
        store.close()


def test_a_launcher_refuses_a_key_file_that_others_can_read(tmp_path: Path) -> None:
    import subprocess
    import sys

    peer = _key_file(tmp_path / "peer", "peer-key-for-the-access-test-0123456789")
    peer.chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "builders.launcher", "--role", "encoder", "--peer-key-file", str(peer),
         "--admin-key-file", str(tmp_path / "admin"), "--model-repository", str(LAUNCHER_REPOSITORY),
         "--http-port", "1", "--grpc-port", "2", "--metrics-port", "3"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "readable by others" in done.stdout and "chmod 600" in done.stdout, done.stdout
