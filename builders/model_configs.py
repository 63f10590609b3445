"""Every generated text file of a target's repository, one function per model (or group).

Tensors come from ``python_backends/contract.py`` (sized with the exported encoder's facts),
parameter keys too; the values come from the target (``builders/targets.py``). Models per
target (names are a contract, docs/architecture.md):

- ``llm``: one colocated vLLM engine (both targets).
- ``preprocess``, ``vit_encoder``, ``vit_positions`` (gpu), ``encode``, ``ensemble``: the encode
  side, written by ``builders/encode_configs.py``.
- ``encoder_<i>`` (``CachePolicy.encoders`` of them): encode by reference -- image in, content
  key, store claim (hit / single-flight join / encode through ``encode`` and write the store),
  signed reference out (``python_backends/encode/cached.py``).
- ``prefill``, ``decode`` (vLLM KV producer / consumer) and ``epd`` (the BLS entry point):
  their model.py is kept in ``model_repository/<name>/1/``; config and engine args are written.

An audio checkpoint's repository (:func:`audio_repository_files`) has ``llm``, ``audio_encoder``
(``cpu``: ONNX Runtime in a python-backend model; ``gpu``: a ``tensorrt_plan`` of the same graph,
built where TensorRT imports), the ``encoder_<i>`` models, ``prefill``, ``decode`` and ``epd``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builders.checkpoint import EncoderFacts, checkpoint_positions
from builders.encode_configs import (
    encode_files,
    encode_gpu,
    ensemble_files,
    preprocess_files,
    preprocessor_config_path,
    vit_encoder_files,
    vit_positions_files,
)
from builders.pbtxt import TEMPLATES, render_parameters, render_template, render_tensors
from builders.targets import Target
from builders.tensorrt_config import AudioTrtProfile, audio_tensorrt_config
from python_backends import contract
from python_backends.contract import ModelInterface
from python_backends.runtime.cpus import parse_cpu_list

AUDIO_ENCODER_MODEL_TEMPLATE = "audio_encoder_model.py"
# Every encoder_<i> serves the kept model.py of encoder_0 (the one always there: encoders >= 1).
ENCODER_MODEL_SOURCE = Path(__file__).resolve().parents[1] / "model_repository" / "encoder_0" / "1" / "model.py"


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def llm_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    # Embeddings by value (``ensemble``, or a client that ran ``encode``) are checked against
    # the exported encoder's output: hidden size and merge size come from its facts.
    interface = contract.LLM.sized(facts.parameters()).taking_videos(_max_videos(target.video_limits)).taking_audios(0)
    embeds = {contract.IMAGE_EMBEDS_HIDDEN_SIZE: facts.hidden_size, contract.SPATIAL_MERGE_SIZE: facts.merge_size}
    config = render_template(
        "llm.pbtxt",
        {
            "target": target.name,
            "instance_kind": target.instance_kind,
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "parameters": render_parameters(target.placed(contract.LLM_MODEL, {
                **target.limits, **target.video_limits, **target.role_environment(contract.LLM_MODEL), **embeds,
                contract.GENERATION_CONFIG: target.generation_config, **target.test_parameters(contract.LLM_MODEL),
            })),
        },
    )
    positions = checkpoint_positions(model_dir)
    role_args = _with_video(target.engine_args_for(contract.LLM_MODEL, positions), target.video_limits)
    engine_args = {"model": str(model_dir.resolve()), **role_args, "enable_mm_embeds": True}
    return {"llm/config.pbtxt": config, "llm/1/engine_args.json": _json(engine_args)}


def _audio_limits(target: Target, model_dir: Path) -> dict[str, Any]:
    """The audio limits of the models that take audio, with the feature extractor's rate."""
    rate = json.loads((model_dir / "preprocessor_config.json").read_text())["sampling_rate"]
    return {**contract.audio_limit_defaults(), **target.audio_limits, contract.AUDIO_SAMPLING_RATE: int(rate)}


def audio_repository_files(target: Target, model_dir: Path) -> dict[str, str]:
    """Every generated text file of an audio checkpoint's repository: ``llm``, ``audio_encoder``
    and the ``encoder_<i>`` models."""
    media = audio_media(target, model_dir)
    return {
        **audio_llm_files(target, model_dir), **audio_encoder_files(target, model_dir),
        **audio_encoders(target, model_dir),
        **kv_stage_files(target, model_dir, media), **epd_files(target, model_dir, media),
    }  # fmt: skip


def audio_llm_files(target: Target, model_dir: Path) -> dict[str, str]:
    """``llm`` of an audio checkpoint (Qwen2-Audio): ``audio`` in, decoded by FFmpeg to the
    feature extractor's rate (python_backends/request/audios.py), the samples to vLLM. No image
    or video input: the model takes neither."""
    audio = _audio_limits(target, model_dir)
    parameters = {
        **target.limits, contract.MAX_IMAGES: 0, contract.MAX_VIDEOS: 0, **audio,
        contract.GENERATION_CONFIG: target.generation_config,
        **target.role_environment(contract.LLM_MODEL), **target.test_parameters(contract.LLM_MODEL),
    }
    config = render_template(
        "llm.pbtxt",
        {
            "target": target.name,
            "instance_kind": target.instance_kind,
            "inputs": render_tensors(contract.AUDIO_LLM.inputs),
            "outputs": render_tensors(contract.AUDIO_LLM.outputs),
            "parameters": render_parameters(target.placed(contract.LLM_MODEL, parameters)),
        },
    )
    role_args = target.engine_args_for(contract.LLM_MODEL, checkpoint_positions(model_dir))
    role_args["limit_mm_per_prompt"] = {"audio": audio[contract.MAX_AUDIOS]}
    engine_args = {"model": str(model_dir.resolve()), **role_args}
    return {"llm/config.pbtxt": config, "llm/1/engine_args.json": _json(engine_args)}


def audio_plan_profile(target: Target, model_dir: Path) -> AudioTrtProfile:
    """The audio encoder plan's profile: the checkpoint's feature window (what its DALI features
    pipeline pads every clip to, and what the ONNX graph was checked with) and up to a request's
    clips (the target's ``max_audios``)."""
    # DALI, which the features config module imports, only where a gpu audio repository is written.
    from python_backends.preprocess.audio_pipeline import AudioFeatureConfig

    features = AudioFeatureConfig.from_dict(json.loads((model_dir / "preprocessor_config.json").read_text()))
    max_clips = int(_audio_limits(target, model_dir)[contract.MAX_AUDIOS])
    return AudioTrtProfile(mel_bins=features.feature_size, frames=features.frames, max_clips=max_clips)


def audio_encoder_files(target: Target, model_dir: Path) -> dict[str, str]:
    """``audio_encoder``: ONNX Runtime on ``audio_encoder/1/model.onnx`` (cpu; its model.py from
    builders/templates, as the repository of an audio checkpoint is never model_repository/), or
    the TensorRT plan ``audio_encoder/1/model.plan`` on the encode side's GPU (gpu; no model.py)."""
    name = contract.AUDIO_ENCODER_MODEL
    serving = target.encode
    if serving.device == "gpu":
        profile = audio_plan_profile(target, model_dir)
        config = audio_tensorrt_config(
            target.name, profile, serving.trt_precision, serving.encoder_instances, encode_gpu(target)
        )
        return {f"{name}/config.pbtxt": config}
    interface = contract.AUDIO_ENCODER
    parameters = {
        contract.ONNX_FILE_KEY: contract.ONNX_FILE, contract.INTRA_OP_THREADS: target.encode.ort_intra_op_threads
    }
    config = render_template(
        "audio_encoder.pbtxt",
        {
            "target": target.name,
            "instances": target.encode.encoder_instances,
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "parameters": render_parameters(target.placed(contract.AUDIO_ENCODER_MODEL, parameters)),
        },
    )
    model_py = (TEMPLATES / AUDIO_ENCODER_MODEL_TEMPLATE).read_text()
    return {f"{name}/config.pbtxt": config, f"{name}/1/model.py": model_py}


def audio_encoders(target: Target, model_dir: Path) -> dict[str, str]:
    """``encoder_<i>`` of an audio checkpoint: audio in (FFmpeg decode, DALI features,
    ``audio_encoder``), store write, references out; keyed by the feature extractor's config and
    the audio encoder's file. The features are DALI's on the CPU on both targets (the serialized
    pipeline runs without a device: no GPU features pipeline is built); on gpu the embeddings come
    back from the plan in CUDA memory and go into the GPU store with one device copy."""
    parameters = {
        **target.cache.to_parameters(),
        **_audio_keys(target, model_dir),
        **_audio_limits(target, model_dir),
        contract.DALI_NUM_THREADS: target.encode.dali_threads,
    }
    model_py = ENCODER_MODEL_SOURCE.read_text()
    files: dict[str, str] = {}
    for name in target.cache.encoder_models:
        files[f"{name}/config.pbtxt"] = _python_model_config(target, name, contract.AUDIO_ENCODER_INSTANCE, parameters)
        if name != contract.encoder_model_names(1)[0]:  # encoder_0's is the kept source, copied
            files[f"{name}/1/model.py"] = model_py
    return files


def _max_videos(video_limits: dict[str, Any]) -> int:
    """``max_videos`` of a model's video limits: 0, the model takes no video, and its config
    declares no ``video`` input (``ModelInterface.taking_videos``) and its engine profiles none."""
    return int(video_limits[contract.MAX_VIDEOS])


def _with_video(role_args: dict[str, Any], video_limits: dict[str, Any]) -> dict[str, Any]:
    """An engine's args with ``video`` in ``limit_mm_per_prompt`` when the model takes video
    (vLLM profiles start-up memory with the largest dummy video the limit allows: measured
    nothing on cpu, docs/benchmarks/video.md)."""
    max_videos = _max_videos(video_limits)
    if max_videos:
        role_args["limit_mm_per_prompt"] = {**role_args.get("limit_mm_per_prompt", {}), "video": max_videos}
    return role_args


def epd_video_limits(target: Target) -> dict[str, Any]:
    """The video limits of ``epd``, its encoders and its engines (``prefill``, ``decode``, the
    colocated one): ``llm``'s on ``cpu``; none on ``gpu``, where video on ``epd`` would go through
    Triton's DALI backend with NVDEC, which is not built (python_backends/encode/videos.py)."""
    if target.encode.device == "gpu":
        return {**target.video_limits, contract.MAX_VIDEOS: 0}
    return dict(target.video_limits)


def _store_parameters(target: Target, merge_size: int) -> dict[str, Any]:
    """What every store user's config carries: the cache policy and the merge size references are checked with."""
    return {**target.cache.to_parameters(), contract.SPATIAL_MERGE_SIZE: merge_size}


def _served_encoder_file(target: Target, model: str) -> str:
    """The file ``model`` serves, relative to the model repository: its digest is the encoder
    version in content keys (on gpu the plan, whose embeddings are not bit for bit the graph's)."""
    return f"{model}/1/{contract.PLAN_FILE if target.encode.device == 'gpu' else contract.ONNX_FILE}"


def _key_parameters(target: Target, model_dir: Path) -> dict[str, Any]:
    """What content keys cover besides the media (read by ``epd`` and the encoders alike)."""
    return {
        contract.PREPROCESSOR_CONFIG: preprocessor_config_path(model_dir),
        contract.ENCODER_FILE: _served_encoder_file(target, contract.VIT_ENCODER_MODEL),
        # torchvision and DALI give different pixels (docs/benchmarks/encode.md): other embeddings.
        contract.IMAGE_BACKEND: target.encode.image_backend,
        contract.VIT_PRECISION: target.encode.vit_precision,  # bf16 embeddings are other embeddings
    }


def _python_model_config(target: Target, name: str, interface: ModelInterface, parameters: dict[str, Any]) -> str:
    return render_template(
        "python_decoupled.pbtxt",
        {
            "target": target.name,
            "name": name,
            "instance_kind": target.instance_kind,
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "parameters": render_parameters(target.placed(name, {**parameters, **target.test_parameters(name)})),
        },
    )


def encoder_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    """``encoder_<i>``: media in, store write, references out (one model per encoder)."""
    model_py = ENCODER_MODEL_SOURCE.read_text()
    parameters = {
        **_store_parameters(target, facts.merge_size),
        **_key_parameters(target, model_dir),
        contract.ENCODE_MODEL_KEY: contract.ENCODE_MODEL,
        # gpu: encode takes one image as UINT8 [1, bytes]; cpu: a request's images as BYTES [n].
        contract.ENCODE_ONE_IMAGE_KEY: target.encode.device == "gpu",
        contract.MAX_IMAGE_BYTES: target.limits[contract.MAX_IMAGE_BYTES],
        **epd_video_limits(target),
        contract.DALI_NUM_THREADS: target.encode.dali_threads,
    }
    interface = contract.ENCODER.taking_videos(_max_videos(epd_video_limits(target))).taking_audios(0)
    files: dict[str, str] = {}
    for name in target.cache.encoder_models:
        files[f"{name}/config.pbtxt"] = _python_model_config(target, name, interface, parameters)
        if name != contract.encoder_model_names(1)[0]:  # encoder_0's is the kept source itself
            files[f"{name}/1/model.py"] = model_py
    return files


@dataclass(frozen=True)
class PipelineMedia:
    """What the pipeline's models (``epd``, ``prefill``, ``decode``, ``epd``'s colocated engine)
    take besides text: the limits in their configs, vLLM's ``limit_mm_per_prompt``, ``epd``'s
    interface, what content keys cover, and the merge size references are checked with. Images
    and video (a Qwen2-VL checkpoint: :func:`image_media`) or audio (:func:`audio_media`)."""

    limits: dict[str, Any]
    per_prompt: dict[str, int]
    epd: ModelInterface
    keys: dict[str, Any]
    merge_size: int
    # prefill's: an audio checkpoint's declares ``audio`` (measurement only, contract.FORWARD_MEDIA).
    prefill: ModelInterface = contract.PREFILL
    prefill_limits: dict[str, Any] = dataclasses.field(default_factory=dict)

    def engine_args(self, target: Target, model_dir: Path, role: str) -> dict[str, Any]:
        """A pipeline engine's args: the target's for ``role``, the checkpoint, these media."""
        role_args = target.engine_args_for(role, checkpoint_positions(model_dir))
        return {"model": str(model_dir.resolve()), **role_args, "limit_mm_per_prompt": self.per_prompt}


def image_media(target: Target, model_dir: Path, facts: EncoderFacts) -> PipelineMedia:
    limits = epd_video_limits(target)
    per_prompt = _with_video(dict(target.engine_args), limits).get("limit_mm_per_prompt", {})
    epd = contract.EPD.taking_videos(_max_videos(limits)).taking_audios(0)
    return PipelineMedia(limits, per_prompt, epd, _key_parameters(target, model_dir), facts.merge_size)


def audio_media(target: Target, model_dir: Path) -> PipelineMedia:
    """An audio checkpoint's: clips only; keys cover the feature extractor's config and the audio
    encoder's file. Both of epd's paths take a clip's embeddings from the store (its encoders
    make them), as for video."""
    audio = _audio_limits(target, model_dir)
    limits = {contract.MAX_IMAGES: 0, contract.MAX_VIDEOS: 0, **audio}
    per_prompt = {"audio": int(audio[contract.MAX_AUDIOS])}
    merge_size = int(contract.default_of(contract.SPATIAL_MERGE_SIZE))  # no grid to check
    keys = _audio_keys(target, model_dir)
    prefill_limits = {**audio, contract.PREPROCESSOR_CONFIG: keys[contract.PREPROCESSOR_CONFIG]}
    return PipelineMedia(
        limits, per_prompt, contract.AUDIO_EPD, keys, merge_size, contract.AUDIO_PREFILL, prefill_limits
    )


def _audio_keys(target: Target, model_dir: Path) -> dict[str, Any]:
    """What an audio clip's content key covers besides its bytes (epd and the encoders alike)."""
    return {
        contract.PREPROCESSOR_CONFIG: preprocessor_config_path(model_dir),
        contract.ENCODER_FILE: _served_encoder_file(target, contract.AUDIO_ENCODER_MODEL),
    }


def kv_stage_files(target: Target, model_dir: Path, media: PipelineMedia) -> dict[str, str]:
    """``prefill`` and ``decode`` (vLLM KV producer / consumer): configs and engine args."""
    # Light: the engine-args helper does not import vLLM.
    from python_backends.pd.engine_args import pd_engine_args

    files: dict[str, str] = {}
    for interface in (media.prefill, contract.DECODE):
        role = interface.name
        parameters = {
            contract.MAX_TOKENS_LIMIT: target.limits[contract.MAX_TOKENS_LIMIT],
            **({contract.STREAM_INTERVAL: target.pd.stream_interval} if role == contract.DECODE_MODEL else {}),
            **(media.prefill_limits if role == contract.PREFILL_MODEL else {}),
            **target.role_environment(role),
            **_store_parameters(target, media.merge_size),
        }
        files[f"{role}/config.pbtxt"] = _python_model_config(target, role, interface, parameters)
        base = media.engine_args(target, model_dir, role)
        args = pd_engine_args(base, role, target.pd.kv_store_path, target.pd.kv_connector)  # type: ignore[arg-type]
        files[f"{role}/1/engine_args.json"] = _json(args)
    return files


PD_ENGINE_MODELS = (contract.EPD_MODEL, contract.PREFILL_MODEL, contract.DECODE_MODEL)


def _engines_apart(target: Target) -> bool:
    """Whether epd's colocated engine has CPUs that prefill's and decode's engines never use (then
    its two paths do not compete for processors: python_backends/epd/path_cost.py)."""
    sets = {model: parse_cpu_list(target.cpu_sets.get(model, "")) for model in PD_ENGINE_MODELS}
    engines = sets[contract.PREFILL_MODEL] | sets[contract.DECODE_MODEL]
    return all(sets.values()) and not sets[contract.EPD_MODEL] & engines


def epd_files(target: Target, model_dir: Path, media: PipelineMedia) -> dict[str, str]:
    """``epd``: the entry point's config (its model.py is kept in model_repository/epd/1/) and the
    engine args of its colocated path's engine (llm's: same model, same embeddings input)."""
    parameters = {
        **target.limits,
        contract.ENCODER_MODELS_KEY: ",".join(target.cache.encoder_models),
        contract.PREFILL_MODEL_KEY: contract.PREFILL_MODEL,
        contract.DECODE_MODEL_KEY: contract.DECODE_MODEL,
        contract.REMOTE_ENCODERS_KEY: target.pd.remote_encoders,
        contract.REMOTE_LOCAL_FALLBACK: target.pd.remote_local_fallback,
        contract.PATH_POLICY: target.pd.path_policy,
        contract.COLOCATED_ENCODES: target.pd.colocated_encodes,
        contract.SHARED_COMPUTE: not _engines_apart(target),
        # Sampling defaults (the checkpoint's generation_config.json), applied before the path is chosen.
        contract.GENERATION_CONFIG: target.generation_config,
        **target.role_environment(contract.EPD_MODEL),
        **media.limits,
        **_store_parameters(target, media.merge_size),
        **media.keys,
    }
    engine_args = {**media.engine_args(target, model_dir, contract.EPD_MODEL), "enable_mm_embeds": True}
    return {
        "epd/config.pbtxt": _python_model_config(target, contract.EPD_MODEL, media.epd, parameters),
        "epd/1/engine_args.json": _json(engine_args),
    }


def repository_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    """Relative path -> content of every generated text file for ``target``."""
    files = llm_files(target, model_dir, facts)
    files.update(preprocess_files(target, model_dir, facts))
    if contract.VIT_POSITIONS_MODEL in target.models:
        files.update(vit_positions_files(target, facts))
    files.update(vit_encoder_files(target, facts))
    files.update(encode_files(target, facts))
    files.update(ensemble_files(target, facts))
    files.update(encoder_files(target, model_dir, facts))
    media = image_media(target, model_dir, facts)
    files.update(kv_stage_files(target, model_dir, media))
    files.update(epd_files(target, model_dir, media))
    return files
