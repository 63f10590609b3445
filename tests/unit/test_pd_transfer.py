"""Pure logic of the prefill -> decode KV transfer: parameters, manifest, store layout, roles."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from python_backends.errors import EpdError, ErrorCode
from python_backends.pd import manifest as mf
from python_backends.pd import transfer as tx
from python_backends.pd.engine_args import check_engine_args, pd_engine_args

TID = "0123456789abcdef0123456789abcdef"
BASE = {"model": "/models/x", "dtype": "float32", "max_model_len": 4096}


def _manifest(tokens=(5, 6, 7, 8, 9), chunks=((0, 3), (3, 5)), mm=(), placeholders=()) -> mf.Manifest:
    return mf.Manifest(
        transfer_id=TID,
        token_ids=list(tokens),
        mm_hashes=list(mm),
        chunks=list(chunks),
        layers=["model.layers.0.self_attn.attn"],
        block_size=128,
        created=1.0,
        mm_placeholders=list(placeholders),
    )


def _commit(store: Path, manifest: mf.Manifest) -> None:
    folder = mf.transfer_dir(store, manifest.transfer_id)
    folder.mkdir(parents=True)
    for start, end in manifest.chunks:
        (folder / mf.chunk_name(start, end)).write_bytes(b"x")
    mf.write_manifest(store, manifest)


def _params(manifest: mf.Manifest, **change) -> dict:
    fields = {"transfer_id": TID, "num_prompt_tokens": manifest.num_tokens, "first_token_id": 42,
              "digest": manifest.digest, **change}  # fmt: skip
    return tx.TransferParams(**fields).to_dict()


# What vLLM 0.32's NixlConnector returns from a prefill request (nixl/pull_scheduler.py).
NIXL_KV = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "prefill-engine", "remote_request_id": "r1", "remote_host": "localhost",
    "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 41,
    "remote_blocks_expiry_time": None, "transfer_mode": "pull",
}  # fmt: skip


def _nixl_params(**change) -> dict:
    fields = {"transfer_id": TID, "num_prompt_tokens": 40, "first_token_id": 7, "digest": "a" * 64,
              "connector": tx.NIXL_CONNECTOR, "kv_transfer_params": NIXL_KV, **change}  # fmt: skip
    return tx.TransferParams(**fields).to_dict()


def _valid(**change) -> dict:
    return {**tx.TransferParams(TID, 3, 1, "a" * 64).to_dict(), **change}


# --------------------------------------------------------------------------- parameters


def test_params_round_trip_is_small_json() -> None:
    params = tx.TransferParams(TID, 300, 17, "a" * 64)
    text = params.to_json()
    assert len(text) < 512
    assert tx.TransferParams.parse(text) == params
    assert tx.TransferParams.parse(text.encode()) == params
    assert tx.TransferParams.parse(json.loads(text)) == params
    assert params.connector == tx.TRANSFER_ID_CONNECTOR


def test_one_contract_for_both_connectors() -> None:
    """The same object, tensor and checks carry each connector's own kv_transfer_params."""
    ours = tx.TransferParams.parse(_valid())
    nixl = tx.TransferParams.parse(_nixl_params())
    assert set(ours.to_dict()) == set(nixl.to_dict())
    assert ours.connector_params() == {tx.KEY_TRANSFER_ID: TID, tx.KEY_DIGEST: "a" * 64, tx.KEY_NUM_TOKENS: 3}
    assert nixl.connector_params() == NIXL_KV  # handed to the decode engine as vLLM made them
    handed = nixl.connector_params()
    handed["do_remote_prefill"] = False  # Nixl's scheduler updates the dict it is given ...
    assert nixl.connector_params()["do_remote_prefill"] is True  # ... not the parsed parameters


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (_valid(version=1), "version"),
        (_valid(transfer_id="../etc"), "transfer_id"),
        (_valid(transfer_id=TID.upper()), "transfer_id"),
        (_valid(num_prompt_tokens=0), "num_prompt_tokens"),
        (_valid(num_prompt_tokens=True), "num_prompt_tokens"),
        (_valid(first_token_id=-1), "first_token_id"),
        (_valid(digest="xyz"), "digest"),
        (_valid(x=1), "unknown"),
        (_valid(connector="ExampleConnector"), "connector"),
        (_valid(kv_transfer_params=[1]), "kv_transfer_params"),
        # TransferIdConnector's parameters must name this very transfer.
        (_valid(kv_transfer_params={tx.KEY_TRANSFER_ID: "f" * 32, tx.KEY_DIGEST: "a" * 64, tx.KEY_NUM_TOKENS: 3}),
         "must name this transfer"),
        (_nixl_params(kv_transfer_params={**NIXL_KV, "do_remote_prefill": False}), "do_remote_prefill"),
        (_nixl_params(kv_transfer_params={k: v for k, v in NIXL_KV.items() if k != "remote_block_ids"}),
         "remote_block_ids"),
        ("x" * (tx.MAX_PARAMS_BYTES + 1), "over"),
    ],
)
def test_params_reject_bad_input(raw, needle) -> None:
    with pytest.raises(EpdError) as err:
        tx.TransferParams.parse(raw)
    assert err.value.code == ErrorCode.INVALID_ARG
    assert needle in err.value.message


def test_connector_params_use_our_own_keys() -> None:
    # vLLM treats Nixl's do_remote_prefill specially (it would overwrite num_cached_tokens).
    keys = tx.TransferParams(TID, 3, 1, "a" * 64).connector_params()
    assert set(keys) == {tx.KEY_TRANSFER_ID, tx.KEY_DIGEST, tx.KEY_NUM_TOKENS}
    assert "do_remote_prefill" not in keys


def test_transfer_dir_refuses_traversal(tmp_path: Path) -> None:
    with pytest.raises(EpdError):
        mf.transfer_dir(tmp_path, "../../etc")
    assert mf.transfer_dir(tmp_path, TID) == tmp_path / TID


# --------------------------------------------------------------------------- manifest


def test_digest_binds_tokens_and_media() -> None:
    base = tx.prompt_digest([1, 2, 3], ["h1"])
    assert base == tx.prompt_digest([1, 2, 3], ["h1"])
    assert base != tx.prompt_digest([1, 2, 4], ["h1"])
    assert base != tx.prompt_digest([1, 2, 3], ["h2"])
    assert base != tx.prompt_digest([1, 2, 3], [])


def test_manifest_commit_and_read(tmp_path: Path) -> None:
    manifest = _manifest(mm=["h"], placeholders=[(1, 2)])
    _commit(tmp_path, manifest)
    assert mf.read_manifest(tmp_path, TID) == manifest
    assert mf.list_transfers(tmp_path) == [TID]


def test_manifest_needs_every_chunk(tmp_path: Path) -> None:
    manifest = _manifest()
    (tmp_path / TID).mkdir()
    (tmp_path / TID / mf.chunk_name(0, 3)).write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        mf.write_manifest(tmp_path, manifest)
    assert not (tmp_path / TID / mf.MANIFEST_NAME).exists()


def test_unknown_transfer_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(EpdError) as err:
        mf.read_manifest(tmp_path, TID)
    assert err.value.code == ErrorCode.NOT_FOUND


@pytest.mark.parametrize(
    "change",
    [
        {"token_ids": [1, 2, 99, 4, 5]},  # digest no longer matches
        {"chunks": [[0, 3]]},  # does not cover the prompt
        {"chunks": [[0, 3], [2, 5]]},  # overlaps
        {"mm_placeholders": [[4, 3]]},  # out of bounds
        {"version": 9},
        {"transfer_id": "zz"},
    ],
)
def test_damaged_manifest_is_internal(tmp_path: Path, change: dict) -> None:
    manifest = _manifest(mm=["h"], placeholders=[(1, 2)])
    _commit(tmp_path, manifest)
    path = tmp_path / TID / mf.MANIFEST_NAME
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(EpdError) as err:
        mf.read_manifest(tmp_path, TID)
    assert err.value.code == ErrorCode.INTERNAL


def test_check_manifest_catches_altered_params(tmp_path: Path) -> None:
    manifest = _manifest()
    mf.check_manifest(tx.TransferParams.parse(_params(manifest)), manifest, 42)
    for change in ({"digest": "b" * 64}, {"num_prompt_tokens": 4}):
        with pytest.raises(EpdError) as err:
            mf.check_manifest(tx.TransferParams.parse(_params(manifest, **change)), manifest, 42)
        assert err.value.code == ErrorCode.INVALID_ARG
    for recorded in (41, None):
        with pytest.raises(EpdError, match="first_token_id"):
            mf.check_manifest(tx.TransferParams.parse(_params(manifest)), manifest, recorded)


def _nixl_manifest(kv=NIXL_KV) -> mf.Manifest:
    return mf.Manifest(
        transfer_id=TID, token_ids=[5, 9, 9, 6], mm_hashes=["img"], chunks=[], layers=[], block_size=0,
        created=1.0, mm_placeholders=[(1, 2)], connector=tx.NIXL_CONNECTOR, kv_params_digest=tx.kv_params_digest(kv),
    )  # fmt: skip


def test_nixl_manifest_holds_no_kv_and_binds_the_connector_params(tmp_path: Path) -> None:
    manifest = _nixl_manifest()
    mf.write_manifest(tmp_path, manifest)  # no chunk files: the KV stays in the prefill engine
    read = mf.read_manifest(tmp_path, TID)
    assert read == manifest and not read.holds_kv
    params = tx.TransferParams.parse(_nixl_params(num_prompt_tokens=4, digest=manifest.digest))
    mf.check_manifest(params, read, 7)
    altered = {**NIXL_KV, "remote_block_ids": [[0, 1, 2]]}  # would read other requests' KV
    for bad in (_nixl_params(num_prompt_tokens=4, digest=manifest.digest, kv_transfer_params=altered),
                tx.TransferParams(TID, 4, 7, manifest.digest).to_dict()):  # fmt: skip
        with pytest.raises(EpdError, match="kv_transfer_params differ") as err:
            mf.check_manifest(tx.TransferParams.parse(bad), read, 7)
        assert err.value.code == ErrorCode.INVALID_ARG


def test_nixl_manifest_without_its_params_digest_is_damaged(tmp_path: Path) -> None:
    mf.write_manifest(tmp_path, dataclasses.replace(_nixl_manifest(), kv_params_digest=""))
    with pytest.raises(EpdError) as err:
        mf.read_manifest(tmp_path, TID)
    assert err.value.code == ErrorCode.INTERNAL


@pytest.mark.parametrize(
    "tokens, sizes, expected",
    [
        ([1, 9, 9, 9, 2], [3], [(1, 3)]),
        ([9, 9, 3, 9, 9, 9, 9], [2, 4], [(0, 2), (3, 4)]),
        ([1, 2, 3], [], []),
    ],
)
def test_placeholder_runs(tokens, sizes, expected) -> None:
    assert mf.placeholder_runs(tokens, 9, sizes) == expected
    assert mf.collapse_placeholders(tokens, expected) == [t for i, t in enumerate(tokens) if t != 9 or
                                                         i == 0 or tokens[i - 1] != 9]  # fmt: skip


def test_placeholder_runs_must_match_the_images() -> None:
    with pytest.raises(ValueError, match="differ"):
        mf.placeholder_runs([1, 9, 9, 2, 9], 9, [2])


def test_first_token_record(tmp_path: Path) -> None:
    (tmp_path / TID).mkdir()
    assert mf.read_first_token(tmp_path, TID) is None
    mf.write_first_token(tmp_path, TID, 7)
    assert mf.read_first_token(tmp_path, TID) == 7


@pytest.mark.parametrize(
    "tokens, placeholders, expected",
    [
        ([1, 9, 9, 9, 2], [(1, 3)], [1, 9, 2]),
        ([9, 9, 3, 8, 8, 8, 8], [(0, 2), (3, 4)], [9, 3, 8]),
        ([1, 2, 3], [], [1, 2, 3]),
    ],
)
def test_collapse_placeholders(tokens, placeholders, expected) -> None:
    assert mf.collapse_placeholders(tokens, placeholders) == expected


@pytest.mark.parametrize("placeholders", [[(3, 4)], [(0, 0)], [(2, 1), (1, 1)]])
def test_collapse_rejects_bad_ranges(placeholders) -> None:
    with pytest.raises(ValueError):
        mf.collapse_placeholders([1, 2, 3, 4], placeholders)


def test_chunks_must_tile_the_prompt() -> None:
    mf.check_chunks_cover([(0, 128), (128, 200)], 200)
    for chunks in ([], [(0, 100)], [(1, 200)], [(0, 100), (101, 200)], [(0, 0), (0, 200)]):
        with pytest.raises(ValueError):
            mf.check_chunks_cover(chunks, 200)


def test_chunk_names_round_trip() -> None:
    assert mf.parse_chunk_name(mf.chunk_name(128, 300)) == (128, 300)
    assert mf.parse_chunk_name("manifest.json") is None


# --------------------------------------------------------------------------- lifetime


def test_remove_and_sweep(tmp_path: Path) -> None:
    old, new = TID, "f" * 32
    for tid in (old, new):
        (tmp_path / tid).mkdir()
    (tmp_path / "not-a-transfer").mkdir()
    past = time.time() - 1000
    os.utime(tmp_path / old, (past, past))
    assert mf.sweep_expired(tmp_path, max_age_s=300) == [old]
    assert mf.list_transfers(tmp_path) == [new]
    assert (tmp_path / "not-a-transfer").exists()
    assert mf.remove_transfer(tmp_path, new) is True
    assert mf.remove_transfer(tmp_path, new) is False
    assert mf.sweep_expired(tmp_path / "missing", 1) == []


# --------------------------------------------------------------------------- engine args per role


def test_role_engine_args() -> None:
    prefill = pd_engine_args(BASE, "prefill", "/dev/shm/kv")
    decode = pd_engine_args(BASE, "decode", "/dev/shm/kv")
    assert prefill["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert decode["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert decode["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in prefill
    for args in (prefill, decode):
        assert args["enable_mm_embeds"] is True
        assert args["kv_transfer_config"]["kv_load_failure_policy"] == "fail"
        assert args["kv_transfer_config"]["kv_connector_extra_config"] == {"store_path": "/dev/shm/kv"}
    assert "kv_transfer_config" not in BASE  # the base dict is not modified
    json.dumps(prefill)  # goes into the JSON beside the Triton model as-is


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"kv_transfer_config": None}, "missing"),
        ({"enable_prefix_caching": True}, "prefix_caching"),
        ({"enable_mm_embeds": False}, "enable_mm_embeds"),
    ],
)
def test_decode_args_that_could_recompute_silently_are_refused(change, needle) -> None:
    args = {**pd_engine_args(BASE, "decode", "/s"), **change}
    with pytest.raises(ValueError, match=needle):
        check_engine_args(args, "decode")


@pytest.mark.parametrize(
    "ktc_change, needle",
    [
        ({"kv_role": "kv_consumer"}, "kv_role"),
        ({"kv_load_failure_policy": "recompute"}, "recompute"),
        ({"kv_connector": "ExampleConnector"}, "TransferIdConnector"),
        ({"kv_connector_extra_config": {}}, "store_path"),
    ],
)
def test_connector_config_is_checked(ktc_change, needle) -> None:
    args = pd_engine_args(BASE, "prefill", "/s")
    args["kv_transfer_config"] = {**args["kv_transfer_config"], **ktc_change}
    with pytest.raises(ValueError, match=needle):
        check_engine_args(args, "prefill")


def test_unknown_role() -> None:
    with pytest.raises(ValueError, match="role"):
        pd_engine_args(BASE, "encode", "/s")  # type: ignore[arg-type]
