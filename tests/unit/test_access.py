"""builders/access.py and the launcher's keys: which categories each key closes, key files, the
generated admin key shown once, and the peer key a pd server's gRPC clients send."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from builders import launcher
from builders.access import (
    ADMIN_HEADER,
    PEER_HEADER,
    Access,
    KeyFileError,
    grpc_header,
    load_or_create_key,
    read_key,
    redacted,
)
from python_backends.scaleout import wire

ADMIN, PEER = "admin-key-0123456789abcdef", "peer-key-0123456789abcdef"


def _restricted(args: tuple[str, ...], flag: str) -> dict[str, tuple[set[str], str]]:
    """header -> (categories, value) of one of Triton's restricted flags."""
    out = {}
    for arg in args:
        if arg.startswith(flag + "="):
            categories, _, setting = arg.removeprefix(flag + "=").partition(":")
            header, _, value = setting.partition("=")
            out[header] = (set(categories.split(",")), value)
    return out


@pytest.mark.parametrize("flag", ["--http-restricted-api", "--grpc-restricted-protocol"])
def test_the_admin_key_closes_the_admin_categories_and_leaves_inference_health_metadata_statistics(flag) -> None:
    for role in ("all", "pd"):
        closed = _restricted(Access(ADMIN, None, role).tritonserver_args(), flag)
        assert closed == {
            ADMIN_HEADER: ({"model-repository", "model-config", "shared-memory", "logging", "trace"}, ADMIN)
        }


@pytest.mark.parametrize("flag", ["--http-restricted-api", "--grpc-restricted-protocol"])
def test_an_encoder_with_a_peer_key_closes_inference_and_its_config_to_all_but_its_peers(flag) -> None:
    closed = _restricted(Access(ADMIN, PEER, "encoder").tritonserver_args(), flag)
    assert closed[PEER_HEADER] == ({"inference", "model-config"}, PEER)
    assert closed[ADMIN_HEADER] == ({"model-repository", "shared-memory", "logging", "trace"}, ADMIN)
    # Without a peer key the encoder's config stays open: the pd servers read it to admit it.
    assert _restricted(Access(ADMIN, None, "encoder").tritonserver_args(), flag)[ADMIN_HEADER][0] == {
        "model-repository", "shared-memory", "logging", "trace"}
    # A pd server's peer key is the one it sends, not one it requires.
    assert PEER_HEADER not in _restricted(Access(ADMIN, PEER, "pd").tritonserver_args(), flag)


def test_no_keys_no_flags_and_keys_are_redacted_when_printed() -> None:
    assert Access().tritonserver_args() == ()
    access = Access(ADMIN, PEER, "encoder")
    printed = " ".join(redacted(["tritonserver", *access.tritonserver_args()], access))
    assert ADMIN not in printed and PEER not in printed and "***" in printed


def test_a_generated_key_is_random_owner_only_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "admin-key"
    key, created = load_or_create_key(path)
    assert created and len(key) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_key(path) == (key, False)
    assert load_or_create_key(tmp_path / "other")[0] != key


@pytest.mark.parametrize(
    ("content", "mode", "error"),
    [
        (ADMIN, 0o644, "readable by others"),
        (ADMIN, 0o640, "readable by others"),
        ("", 0o600, "must hold one key"),
        ("short", 0o600, "must hold one key"),
        ("has space in it 0123456789", 0o600, "must hold one key"),
        ("colon:and=equals-0123456789", 0o600, "must hold one key"),  # would break Triton's KEY=VALUE
    ],
)
def test_a_bad_key_file_is_refused_saying_why(tmp_path: Path, content: str, mode: int, error: str) -> None:
    path = tmp_path / "key"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match=error):
        read_key(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        read_key(tmp_path / "missing")


def _key_file(path: Path, key: str) -> Path:
    path.write_text(key)
    path.chmod(0o600)
    return path


def test_the_launcher_shows_a_generated_admin_key_once_then_only_where_it_is(tmp_path, capsys) -> None:
    args = launcher.parse_args(["--admin-key-file", str(tmp_path / "admin")])
    access, env = launcher.server_access(args)
    first = capsys.readouterr().out
    assert access.admin_key and f"admin key (shown once): {access.admin_key}" in first and env == {}
    again, _ = launcher.server_access(args)
    second = capsys.readouterr().out
    assert again.admin_key == access.admin_key and access.admin_key not in second and str(tmp_path / "admin") in second


def test_open_admin_apis_leaves_them_open_and_writes_no_key(tmp_path, capsys) -> None:
    args = launcher.parse_args(["--open-admin-apis", "--admin-key-file", str(tmp_path / "admin")])
    access, _ = launcher.server_access(args)
    assert access.tritonserver_args() == () and not (tmp_path / "admin").exists()


def test_open_admin_apis_with_categories_opens_only_those(tmp_path, capsys) -> None:
    args = launcher.parse_args(["--open-admin-apis", "model-config", "shared-memory",
                                "--admin-key-file", str(tmp_path / "admin")])  # fmt: skip
    closed = _restricted(launcher.server_access(args)[0].tritonserver_args(), "--grpc-restricted-protocol")
    assert closed[ADMIN_HEADER][0] == {"model-repository", "logging", "trace"}
    with pytest.raises(SystemExit):
        launcher.parse_args(["--open-admin-apis", "inference"])


def test_the_peer_key_is_required_by_an_encoder_and_handed_to_a_pd_servers_stubs(tmp_path) -> None:
    peer = _key_file(tmp_path / "peer", PEER)
    common = ["--open-admin-apis", "--peer-key-file", str(peer)]
    encoder, env = launcher.server_access(launcher.parse_args(["--role", "encoder", *common]))
    assert encoder.peer_key == PEER and env == {}
    pd, env = launcher.server_access(launcher.parse_args(["--role", "pd", *common]))
    assert pd.peer_key is None and env == {wire.PEER_KEY_FILE_ENV: str(peer)}
    with pytest.raises(SystemExit):
        launcher.parse_args(["--role", "all", *common])
    peer.chmod(0o644)  # refused at the start, not at the first encode
    with pytest.raises(KeyFileError):
        launcher.server_access(launcher.parse_args(["--role", "pd", *common]))


def test_triton_binds_loopback_unless_told(tmp_path) -> None:
    assert launcher.parse_args([]).host == "127.0.0.1"
    assert launcher.parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"


def test_a_pd_servers_grpc_clients_send_the_peer_key_from_its_file(tmp_path) -> None:
    peer = _key_file(tmp_path / "peer", PEER + "\n")
    assert wire.peer_key({}) is None
    assert wire.peer_key({wire.PEER_KEY_FILE_ENV: str(peer)}) == PEER
    request = type("Request", (), {"headers": {}})()
    wire.PeerKey(PEER)(request)
    assert request.headers == {grpc_header(PEER_HEADER): PEER} == {wire.PEER_KEY_METADATA: PEER}
    with pytest.raises(Exception, match="key file"):
        wire.peer_key({wire.PEER_KEY_FILE_ENV: str(tmp_path / "missing")})


def test_the_tenant_secret_reaches_tritonserver_and_a_bad_one_stops_the_start(tmp_path) -> None:
    from python_backends.request.tenants import TENANT_SECRET_FILE_ENV, TenantSecretError

    secret = _key_file(tmp_path / "tenant-secret", "s" * 40)
    args = launcher.parse_args(["--open-admin-apis", "--tenant-secret-file", str(secret)])
    assert launcher.server_access(args)[1] == {TENANT_SECRET_FILE_ENV: str(secret)}
    secret.chmod(0o644)
    with pytest.raises(TenantSecretError):
        launcher.server_access(args)


def test_the_demo_sends_a_key_the_openai_api_takes(tmp_path) -> None:
    assert launcher.demo_api_key(launcher.parse_args(["--openai-port", "9000"])) is None
    given = launcher.parse_args(["--openai-port", "9000", "--api-key", "k1", "k2"])
    assert launcher.demo_api_key(given) == "k1"
    keys = _key_file(tmp_path / "keys", "# comment\nfile-key-1 acme\nfile-key-2 -\n")
    assert launcher.demo_api_key(launcher.parse_args(["--openai-port", "9000", "--api-keys-file", str(keys)])) == (
        "file-key-1")
