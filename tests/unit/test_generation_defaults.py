"""Sampling defaults from the checkpoint's generation_config.json (python_backends/request/
generation_defaults.py): the same as vLLM 0.32's own ``ModelConfig.get_diff_sampling_param`` for
each setting (auto, vllm, a folder) on folders written here and on the tiny default checkpoint;
the errors; what a model keeps at load (``defaults_for_model``) and how a request's own values
win over them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from python_backends import contract
from python_backends.request.generation_defaults import (
    SAMPLING_FIELDS,
    defaults_for_model,
    resolve_setting,
    sampling_defaults,
)
from python_backends.request.sampling import SamplingLimits, parse_sampling_parameters
from python_backends.runtime.model_params import ModelParameters

# Qwen2-VL-2B-Instruct's generation_config.json, as the hub ships it.
QWEN2_VL_2B_INSTRUCT = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.01,
    "top_p": 0.001,
    "top_k": 1,
    "transformers_version": "4.41.2",
}
# Folder name -> its generation_config.json (None: no file).
FOLDERS: dict[str, dict[str, Any] | None] = {
    "qwen2-vl-2b-instruct": QWEN2_VL_2B_INSTRUCT,
    "max-new-tokens": {"max_new_tokens": 512, "temperature": 0.7, "top_k": 50, "top_p": 1.0, "min_p": 0.0},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.1, "temperature": 0.0, "top_k": 0},
    "max-new-tokens-null": {"max_new_tokens": None, "do_sample": False, "temperature": 0.2},
    "nothing": {},
    "tokens-only": {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False},
    "config-json-only": None,  # the checkpoint's config.json, no generation_config.json
}
EXPECTED = {
    "qwen2-vl-2b-instruct": {"repetition_penalty": 1.05, "temperature": 0.01, "top_k": 1, "top_p": 0.001},
    "max-new-tokens": {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "max_tokens": 512},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.1, "temperature": 0.0, "top_k": 0},
    "max-new-tokens-null": {"temperature": 0.2},
    "nothing": {},
    "tokens-only": {},
    "config-json-only": {},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("generation-configs")
    for name, config in FOLDERS.items():
        folder = root / name
        folder.mkdir()
        if config is None:
            shutil.copy(model_dir / "config.json", folder / "config.json")
        else:
            (folder / "generation_config.json").write_text(json.dumps(config))
    (root / "neither").mkdir()  # no generation_config.json, no config.json
    return root


@pytest.fixture(scope="module")
def vllm_defaults(model_dir: Path) -> Any:
    """vLLM's own answer: ``ModelConfig(model, generation_config=setting).get_diff_sampling_param()``."""
    from vllm.config import ModelConfig

    def defaults(setting: str, model: Path = model_dir) -> dict[str, Any]:
        return ModelConfig(model=str(model), generation_config=setting).get_diff_sampling_param()

    return defaults


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_a_folder_gives_what_vllms_get_diff_sampling_param_gives(
    name: str, folders: Path, model_dir: Path, vllm_defaults: Any
) -> None:
    folder = str(folders / name)
    ours = sampling_defaults(folder, model_dir)
    assert ours == vllm_defaults(folder) == EXPECTED[name]
    assert list(ours) == list(vllm_defaults(folder))  # the same order too
    assert set(ours) <= {"max_tokens", *SAMPLING_FIELDS} - {"max_new_tokens"}


def test_auto_reads_the_checkpoint_as_vllm_does(
    tmp_path: Path, folders: Path, model_dir: Path, vllm_defaults: Any
) -> None:
    # The tiny default checkpoint sets no sampling field (builders/tiny_checkpoint.py says why).
    assert sampling_defaults("auto", model_dir) == vllm_defaults("auto") == {}
    # The same checkpoint with Qwen2-VL-2B-Instruct's generation_config.json.
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(model_dir, checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps(QWEN2_VL_2B_INSTRUCT))
    expected = EXPECTED["qwen2-vl-2b-instruct"]
    assert sampling_defaults("auto", checkpoint) == vllm_defaults("auto", checkpoint) == expected
    # Without generation_config.json: config.json's generation fields (none), as vLLM.
    (checkpoint / "generation_config.json").unlink()
    assert sampling_defaults("auto", checkpoint) == vllm_defaults("auto", checkpoint) == {}


def test_vllm_setting_reads_nothing(tmp_path: Path, folders: Path, vllm_defaults: Any) -> None:
    checkpoint = folders / "qwen2-vl-2b-instruct"
    assert sampling_defaults("vllm", checkpoint) == vllm_defaults("vllm") == {}
    assert sampling_defaults("vllm", tmp_path / "absent") == {}  # not even the checkpoint is opened


def test_a_folder_with_neither_file_is_refused_as_vllm_refuses_it(
    folders: Path, model_dir: Path, vllm_defaults: Any
) -> None:
    neither = str(folders / "neither")
    with pytest.raises(ValueError, match="holds neither generation_config.json nor config.json; pass 'auto'"):
        sampling_defaults(neither, model_dir)
    with pytest.raises(ValueError):  # vLLM: "Invalid repository ID or local directory specified"
        vllm_defaults(neither)


@pytest.mark.parametrize("setting", ["", "Auto", "bogus", "/nonexistent/generation-config"])
def test_a_setting_neither_auto_vllm_nor_a_folder_says_what_to_pass(setting: str, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a folder: pass 'auto' .* 'vllm' .* a folder"):
        sampling_defaults(setting, model_dir)


def test_a_file_is_not_a_folder(tmp_path: Path, model_dir: Path) -> None:
    file = tmp_path / "generation_config.json"
    file.write_text("{}")
    with pytest.raises(ValueError, match="nor a folder"):
        resolve_setting(str(file))


def test_a_folder_setting_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gen").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_setting("gen") == str((tmp_path / "gen").resolve())
    assert resolve_setting("auto") == "auto" and resolve_setting("vllm") == "vllm"


def model_params(setting: str | None = None, **values: Any) -> ModelParameters:
    parameters = {key: {"string_value": str(value)} for key, value in values.items()}
    if setting is not None:
        parameters[contract.GENERATION_CONFIG] = {"string_value": setting}
    return ModelParameters.from_model_config({"name": "llm", "parameters": parameters})


def test_defaults_for_model_reads_its_generation_config_parameter(folders: Path, model_dir: Path) -> None:
    qwen = folders / "qwen2-vl-2b-instruct"
    assert defaults_for_model(model_params(str(qwen)), model_dir) == EXPECTED["qwen2-vl-2b-instruct"]
    assert defaults_for_model(model_params("vllm"), qwen) == {}
    assert defaults_for_model(model_params(), qwen) == EXPECTED["qwen2-vl-2b-instruct"]  # absent: auto
    with pytest.raises(ValueError, match="model 'llm': generation_config 'bogus' is neither"):
        defaults_for_model(model_params("bogus"), model_dir)


def test_a_default_max_tokens_is_cut_to_the_models_limit(folders: Path, model_dir: Path) -> None:
    setting = str(folders / "max-new-tokens")  # max_new_tokens 512
    assert defaults_for_model(model_params(setting), model_dir)["max_tokens"] == 512
    cut = defaults_for_model(model_params(setting, **{contract.MAX_TOKENS_LIMIT: 100}), model_dir)
    assert cut["max_tokens"] == 100


def test_a_default_every_request_would_fail_on_fails_the_load(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 1.5}))
    with pytest.raises(ValueError, match="would fail every request .*top_p.* set generation_config to 'vllm'"):
        defaults_for_model(model_params(str(tmp_path)), model_dir)


def test_the_requests_own_values_win_then_the_defaults(folders: Path, model_dir: Path) -> None:
    defaults = defaults_for_model(model_params(str(folders / "qwen2-vl-2b-instruct")), model_dir)
    params = parse_sampling_parameters(json.dumps({"temperature": 0.5}), SamplingLimits(), defaults)
    assert params["temperature"] == 0.5  # the request's
    assert (params["top_k"], params["top_p"], params["repetition_penalty"]) == (1, 0.001, 1.05)  # the checkpoint's
    assert parse_sampling_parameters(None, SamplingLimits(), {})["max_tokens"] == 16  # vLLM's default
