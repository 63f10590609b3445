"""The contract (python_backends/contract) against both of its sides.

Build side: every config.pbtxt generated for each target has exactly the tensors the contract
declares for that model, and only parameters the model is declared to read, with values that
parse. Serving side: every tensor name, parameter key and model name that a model.py, a
template model or a BLS call writes as a literal is declared in the contract. So a name
changed in the contract alone breaks the configs' check (the builders render from it) or the
source check (a literal left behind).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
from builders.repository import TARGETS, RepositoryBuildError, write_repository
from python_backends import contract
from python_backends.runtime.model_params import ModelParameters
from tests.unit.repository_helpers import FACTS, fake_artifact_builds

REPO_ROOT = Path(__file__).resolve().parents[2]
DataType = model_config_pb2.DataType


@pytest.fixture(scope="module")
def repositories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both targets' repositories, generated as `python -m builders.repository` writes them; the
    ONNX export (tested in test_encoder_export.py) and the TensorRT build are replaced."""
    model_dir = build_default_model()

    patch = pytest.MonkeyPatch()
    fake_artifact_builds(patch)
    try:
        out = {}
        for target in sorted(TARGETS):
            out[target] = tmp_path_factory.mktemp(f"repository_{target}")
            write_repository(target, model_dir, out[target], tmp_path_factory.mktemp(f"stamps_{target}"))
        return out
    finally:
        patch.undo()


def generated_configs(root: Path) -> Iterator[model_config_pb2.ModelConfig]:
    for path in sorted(root.glob("*/config.pbtxt")):
        yield text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def config_tensors(entries) -> list[tuple]:
    return [
        (
            e.name,
            DataType.Name(e.data_type),
            tuple(e.dims),
            e.optional if hasattr(e, "optional") else False,
            e.allow_ragged_batch if hasattr(e, "allow_ragged_batch") else False,
            tuple(e.reshape.shape) if e.HasField("reshape") else None,
        )
        for e in entries
    ]


def contract_tensors(specs: tuple[contract.TensorSpec, ...]) -> list[tuple]:
    return [(t.name, t.data_type, t.dims, t.optional, t.ragged, t.reshape) for t in specs]


def declared_interface(config: model_config_pb2.ModelConfig) -> contract.ModelInterface:
    """The contract's interface (of the model's name) that the config's tensors are; of several
    with those tensors (``audio_encoder`` on cpu and gpu), the one that reads its parameters."""
    found = (config_tensors(config.input), config_tensors(config.output))
    candidates = [i.sized(FACTS.parameters()) for i in contract.interfaces_of(config.name)]
    matching = [
        interface
        for interface in candidates
        if (contract_tensors(interface.inputs), contract_tensors(interface.outputs)) == found
    ]
    for interface in matching:
        if all(interface.accepts_parameter(key) for key in config.parameters):
            return interface
    if matching:  # the caller's parameter check says which one is not the contract's
        return matching[0]
    raise AssertionError(
        f"{config.name}: tensors {found} are none of the contract's {[(c.inputs, c.outputs) for c in candidates]}"
    )


def parses(key: str, value: str) -> None:
    default = contract.default_of(key)
    if isinstance(default, bool):
        contract.parse_boolean(key, value)
    elif isinstance(default, int) or key in contract.ENCODER_FACTS:
        contract.parse_integer(key, value)
    elif isinstance(default, float):
        contract.parse_number(key, value)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_generated_config_is_the_contract(target: str, repositories: dict[str, Path]) -> None:
    configs = {c.name: c for c in generated_configs(repositories[target])}
    assert set(configs) == set(TARGETS[target].models)
    for name, config in configs.items():
        interface = declared_interface(config)
        values = {key: entry.string_value for key, entry in config.parameters.items()}
        for key, value in values.items():
            assert interface.accepts_parameter(key), f"{name} has parameter {key!r} the contract does not give it"
            if not key.startswith(contract.ENGINE_ENV_PREFIXES):
                parses(key, value)
        if config.backend == "python":  # what its model.py cannot do without
            required = {key for key in interface.parameters if contract.default_of(key) is None}
            assert required <= set(values), f"{name} lacks required parameters {required - set(values)}"
        for step in config.ensemble_scheduling.step:  # ensembles connect declared tensors only
            model = configs[step.model_name]
            assert set(step.input_map) <= {i.name for i in model.input}, step.model_name
            assert set(step.output_map) <= {o.name for o in model.output}, step.model_name
            assert {*step.input_map.values(), *step.output_map.values()} <= contract.tensor_names()


def test_each_target_declares_its_own_encode_side(repositories: dict[str, Path]) -> None:
    """cpu: ``preprocess``, ``vit_encoder``, ``encode`` and ``ensemble`` take a request's 0..N
    images at once (not batched); gpu: the DALI backend's batched interface, the TensorRT plan and
    the one-image ``encode`` and ``ensemble``."""
    expected = {
        "cpu": (contract.PREPROCESS, contract.VIT_ENCODER, contract.ENCODE, contract.ENSEMBLE),
        "gpu": (
            contract.PREPROCESS_DALI,
            contract.VIT_ENCODER_TENSORRT,
            contract.ENCODE_ONE_IMAGE,
            contract.ENSEMBLE_ONE_IMAGE,
        ),
    }
    for target, interfaces in expected.items():
        configs = {c.name: c for c in generated_configs(repositories[target])}
        for interface in interfaces:
            found = declared_interface(configs[interface.name])
            assert found == interface.sized(FACTS.parameters()), (target, interface.name)
            batched = TARGETS[target].encode.max_batch_size if interface is contract.PREPROCESS_DALI else 0
            assert configs[interface.name].max_batch_size == batched, (target, interface.name)
    # preprocess/1/model.py reads the same input whichever of the two it serves
    # (tests/server/test_gpu_topology.py serves the DALI interface with it on the CPU).
    assert contract.PREPROCESS.input_names == contract.PREPROCESS_DALI.input_names == (contract.IMAGE,)
    assert contract.ENSEMBLE.tensor(contract.IMAGE) == contract.LLM.tensor(contract.IMAGE)  # as llm takes images


def test_an_image_only_repository_is_the_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_videos`` 0: the models that take video declare the contract's interface less ``video``."""
    fake_artifact_builds(monkeypatch)
    write_repository("cpu", build_default_model(), tmp_path / "repository", tmp_path / "stamps", max_videos=0)
    configs = {c.name: c for c in generated_configs(tmp_path / "repository")}
    for name in ("llm", "epd", *TARGETS["cpu"].cache.encoder_models):
        with_video = contract.interfaces_of(name)[0].input_names
        assert declared_interface(configs[name]).input_names == tuple(i for i in with_video if i != contract.VIDEO)


def test_store_users_carry_the_cache_policy_and_read_it_back(repositories: dict[str, Path]) -> None:
    for target, root in repositories.items():
        policy = TARGETS[target].cache
        for config in generated_configs(root):
            values = {key: entry.string_value for key, entry in config.parameters.items()}
            if contract.STORE_PATH in values:
                expected = dataclasses.replace(policy, encoders=contract.CachePolicy().encoders)
                assert contract.CachePolicy.from_parameters(values) == expected, config.name
                assert ModelParameters(config.name, values).store_config().capacity_bytes == policy.capacity_bytes


def test_model_parameters_fall_back_to_the_contracts_one_default() -> None:
    empty = ModelParameters("m", {})
    for key, declared in contract.PARAMETERS.items():
        if declared.default is None:
            with pytest.raises(ValueError, match=f"'{key}' is required"):
                empty.string(key)
        elif isinstance(declared.default, bool):
            assert empty.boolean(key) is declared.default
        elif isinstance(declared.default, int):
            assert empty.integer(key) == declared.default
        elif isinstance(declared.default, float):
            assert empty.number(key) == declared.default
        else:
            assert empty.string(key) == declared.default
    # The store's capacity has one home (python_backends/store/config.py).
    from python_backends.store import DEFAULT_CAPACITY_BYTES, StoreConfig

    assert contract.CachePolicy().capacity_bytes == StoreConfig().capacity_bytes == DEFAULT_CAPACITY_BYTES
    assert empty.store_config().capacity_bytes == DEFAULT_CAPACITY_BYTES
    with pytest.raises(ValueError, match="model 'm': parameter 'max_images' must be >= 0, got -1"):
        ModelParameters("m", {contract.MAX_IMAGES: "-1"}).integer(contract.MAX_IMAGES)


def test_the_contract_is_one_namespace() -> None:
    """Every public name defined in a part of the package is ``contract.<name>`` (the package
    re-exports its parts; a name missing from a part's ``__all__`` would not be)."""
    parts = sorted((REPO_ROOT / "python_backends" / "contract").glob("[!_]*.py"))
    assert {p.stem for p in parts} == {"interfaces", "names", "parameters"}
    for part in parts:
        tree = ast.parse(part.read_text())
        defined = {
            target.id
            for node in tree.body
            for target in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
            if isinstance(target, ast.Name)
        } | {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        missing = {name for name in defined if not name.startswith("_") and name != "__all__"} - set(vars(contract))
        assert not missing, f"{part.name}: {sorted(missing)}"


def test_the_contract_imports_without_triton_torch_or_vllm() -> None:
    probe = (
        "import sys; import python_backends.contract; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm', 'triton_python_backend_utils', "
        "'tritonclient', 'transformers', 'onnxruntime', 'nvidia'}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# The serving side: every literal name is declared
# ---------------------------------------------------------------------------------------------

TENSOR_CALLS = {"Tensor": 0, "bytes_tensor": 0, "tensor": 0, "get_input_tensor_by_name": 1}
PARAMETER_READS = {"string", "integer", "number", "boolean"}
TENSOR_MAPS = {"inputs", "outputs", "out", "result", "response", "tensors"}  # name -> array dicts
NAME_LISTS = ("INPUT_NAMES", "OUTPUT_NAMES", "OUTPUT_NAME", "INPUTS", "OUTPUTS")


def serving_sources() -> list[Path]:
    """model.py files (kept and template), and the runtime, including its BLS calls."""
    return sorted([*model_files(), *REPO_ROOT.glob("python_backends/**/*.py")])


def model_files() -> list[Path]:
    """Kept model.py files and the template models (generated encoder_<i> copies left out)."""
    kept = REPO_ROOT.glob("model_repository/*/1/model.py")
    return [p for p in kept if not p.parent.parent.name.startswith("encoder_")] + list(
        REPO_ROOT.glob("builders/templates/*.py")
    )


def _strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def literal_names(tree: ast.AST) -> Iterator[tuple[str, str, int]]:
    """(kind, literal, line) for every name written as a literal where code names a tensor, a
    parameter or a model."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = _callee(node)
            if callee in TENSOR_CALLS and len(node.args) > TENSOR_CALLS[callee]:
                yield from (("tensor", s, node.lineno) for s in _strings(node.args[TENSOR_CALLS[callee]]))
            if callee == "read_inputs" and len(node.args) > 1:
                yield from (("tensor", s, node.lineno) for s in _strings(node.args[1]))
            if callee in PARAMETER_READS and isinstance(node.func, ast.Attribute) and node.args:
                yield from (("parameter", s, node.lineno) for s in _strings(node.args[0]))
            # Request parsers read tensors from a name -> array mapping: f(inputs, "name") or inputs.get("name").
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Name) and first.id in TENSOR_MAPS and len(node.args) > 1:
                yield from (("tensor", s, node.lineno) for s in _strings(node.args[1]))
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            if callee == "get" and isinstance(receiver, ast.Name) and receiver.id in TENSOR_MAPS and node.args:
                yield from (("tensor", s, node.lineno) for s in _strings(node.args[0]))
            for keyword in node.keywords:
                if keyword.arg == "requested_output_names":
                    yield from (("tensor", s, node.lineno) for s in _strings(keyword.value))
                if keyword.arg == "model_name":
                    yield from (("model", s, node.lineno) for s in _strings(keyword.value))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in TENSOR_MAPS:
            yield from (("tensor", s, node.lineno) for s in _strings(node.slice))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.endswith(NAME_LISTS) for t in targets):
                yield from (("tensor", s, node.lineno) for s in _strings(node.value))


def declared(kind: str, name: str) -> bool:
    if kind == "tensor":
        return name in contract.tensor_names()
    if kind == "parameter":
        return name in contract.PARAMETERS or name.startswith(contract.ENGINE_ENV_PREFIXES)
    try:
        contract.interfaces_of(name)
    except contract.ContractError:
        return False
    return True


def test_every_literal_name_in_the_serving_code_is_declared() -> None:
    sources = serving_sources()
    assert any(p.name == "model.py" for p in sources) and any("templates" in p.parts for p in sources)
    unknown = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {kind} {name!r}"
        for path in sources
        for kind, name, line in literal_names(ast.parse(path.read_text(), str(path)))
        if not declared(kind, name)
    ]
    assert not unknown, "names not declared in python_backends/contract:\n" + "\n".join(unknown)


def test_model_files_and_bls_calls_write_no_declared_name_as_a_literal() -> None:
    """Where the contract is used most (model.py files, template models, the BLS calls), names
    come from it as constants: a bare literal of a declared tensor name or parameter key (any
    string constant but a docstring) would not follow a rename in the contract."""
    names = contract.tensor_names() | set(contract.PARAMETERS)
    bls = sorted(REPO_ROOT.glob("python_backends/triton_edge/bls.py"))
    bare = []
    for path in [*model_files(), *bls]:
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        bare += [
            f"{path.relative_to(REPO_ROOT)}:{n.lineno}: {n.value!r}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names and id(n) not in docstrings
        ]
    assert not bare, "write these as python_backends.contract constants:\n" + "\n".join(bare)


def test_the_source_check_sees_literals() -> None:
    """The scanner itself: each way of naming a tensor, parameter or model is found."""
    code = """
pb_utils.Tensor("t1", x); bytes_tensor("t2", []); pb_utils.get_input_tensor_by_name(request, "t3")
read_inputs(request, ("t4", "t5")); params.integer("p1", 3); _scalar(inputs, "t6"); inputs.get("t7")
out["t8"]; INPUT_NAMES = ("t9",); pb_utils.InferenceRequest(model_name="m1", requested_output_names=["t10"])
"""
    found = {(kind, name) for kind, name, _ in literal_names(ast.parse(code))}
    assert found == {("tensor", f"t{i}") for i in range(1, 11)} | {("parameter", "p1"), ("model", "m1")}


def test_an_audio_checkpoints_repository_serves_audio_on_llm_and_epd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audio checkpoint's repository, written over an image one: ``llm`` declaring the
    contract's audio interface, ``audio_encoder`` and the ``encoder_<i>`` models taking audio, with
    the limits and the checkpoint's sampling rate, ``epd`` (disaggregated) with ``prefill`` and
    ``decode`` taking audio embeddings; the image models' folders are gone, the engines take audio
    only, and model_repository/ (the kept code) is refused."""
    fake_artifact_builds(monkeypatch)
    out = tmp_path / "repository"
    write_repository("cpu", build_default_model(), out, tmp_path / "stamps")
    audio_model = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    write_repository("cpu", audio_model, out, tmp_path / "stamps")
    configs = {c.name: c for c in generated_configs(out)}
    encoders = TARGETS["cpu"].cache.encoder_models
    assert set(configs) == {contract.LLM_MODEL, contract.AUDIO_ENCODER_MODEL, *encoders, "epd", "prefill", "decode"}
    assert declared_interface(configs[contract.EPD_MODEL]) == contract.AUDIO_EPD
    epd_values = {key: entry.string_value for key, entry in configs[contract.EPD_MODEL].parameters.items()}
    assert epd_values[contract.ENCODER_FILE] == "audio_encoder/1/model.onnx"
    for role in ("prefill", "decode", "epd"):  # epd's: its colocated engine's
        role_args = json.loads((out / role / "1" / "engine_args.json").read_text())
        assert role_args["limit_mm_per_prompt"] == {"audio": 2} and role_args["enable_mm_embeds"], role
    # Nothing else is left for Triton to find (an image model's artefacts would stop its start).
    assert {p.name for p in out.iterdir()} == set(configs)
    assert declared_interface(configs[contract.LLM_MODEL]) == contract.AUDIO_LLM
    assert declared_interface(configs[contract.AUDIO_ENCODER_MODEL]) == contract.AUDIO_ENCODER
    encoder_source = (REPO_ROOT / "model_repository" / "encoder_0" / "1" / "model.py").read_text()
    for name in encoders:
        assert declared_interface(configs[name]) == contract.AUDIO_ENCODER_INSTANCE
        assert (out / name / "1" / "model.py").read_text() == encoder_source
        values = {key: entry.string_value for key, entry in configs[name].parameters.items()}
        assert values[contract.ENCODER_FILE] == "audio_encoder/1/model.onnx"
        assert values[contract.PREPROCESSOR_CONFIG] == str(audio_model / "preprocessor_config.json")
    values = {key: entry.string_value for key, entry in configs[contract.LLM_MODEL].parameters.items()}
    assert values[contract.MAX_AUDIOS] == "2" and values[contract.AUDIO_SAMPLING_RATE] == "16000"
    assert values[contract.MAX_IMAGES] == "0" and values[contract.MAX_VIDEOS] == "0"
    engine_args = json.loads((out / "llm" / "1" / "engine_args.json").read_text())
    assert engine_args["limit_mm_per_prompt"] == {"audio": 2} and engine_args["model"] == str(audio_model)
    with pytest.raises(RepositoryBuildError, match="--role all"):
        write_repository("cpu", audio_model, tmp_path / "encoder", tmp_path / "stamps", role="encoder")
    with pytest.raises(RepositoryBuildError, match="a folder of its own"):
        write_repository("cpu", audio_model, REPO_ROOT / "model_repository", tmp_path / "stamps")
