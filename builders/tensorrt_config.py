"""The gpu target's TensorRT plans: their optimisation profiles and their config.pbtxt.

``vit_encoder``: the plan encodes one image per request (``max_batch_size`` 0) with the exported
graph's own inputs (``builders/encoder.py``, ``PerImageVisionTower``): ``pixel_values`` ``[frames,
patches, width]`` with frames 1 and folded rows (``image_patch_dim`` wide: what preprocess sends),
and one frame's ``rotary_pos_ids`` ``[patches, 2]`` (``vit_positions``). Only the patch count
varies (:class:`TrtProfile`). ``image_embeds`` carries a leading 1 on the wire, so that ``encode``
has the cpu target's shapes; the config's ``reshape`` gives the engine its own ``[tokens,
hidden]`` (python_backends/contract, ``VIT_ENCODER_TENSORRT``).

``audio_encoder`` (an audio checkpoint's): the plan takes the ONNX Runtime model's tensors as
they are (``AUDIO_ENCODER_TENSORRT``: same names, dims and dtypes), so ``encoder_<i>`` calls it
unchanged; only the clip count varies (:class:`AudioTrtProfile`).

CUDA graphs are captured for fixed input shapes, written in the ENGINE's dims: Triton's
TensorRT backend passes a graph spec's shapes to ``setInputShape`` as they are, without a
config's reshape, so a graph written in other dims than the engine's would never match and would
silently never be captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from builders.pbtxt import render_dims, render_parameters, render_template, render_tensors
from python_backends import contract

SizedShape = tuple[int, ...]
ShapeRange = tuple[SizedShape, SizedShape, SizedShape]  # an input's (min, opt, max) engine shape


@dataclass(frozen=True)
class TrtProfile:
    """The vision plan's one optimisation profile: the patches of the one image of a call.

    Defaults fit the tiny default model (max_pixels 448*448 = 1024 patches); a real checkpoint
    sets these from its pixel limits (:meth:`from_pixel_limits`).
    """

    min_patches: int = contract.default_of(contract.PROFILE_MIN_PATCHES)
    opt_patches: int = contract.default_of(contract.PROFILE_OPT_PATCHES)
    max_patches: int = contract.default_of(contract.PROFILE_MAX_PATCHES)

    def validate(self, merge_size: int = 2) -> None:
        block = merge_size * merge_size
        if not 0 < self.min_patches <= self.opt_patches <= self.max_patches:
            raise ValueError(f"need 0 < min <= opt <= max patches, got {self}")
        if any(n % block for n in (self.min_patches, self.opt_patches, self.max_patches)):
            raise ValueError(f"patch counts must be multiples of {block} (merge_size**2), got {self}")

    @classmethod
    def from_pixel_limits(cls, min_pixels: int, max_pixels: int, patch_size: int, merge_size: int = 2) -> TrtProfile:
        """The profile a checkpoint's resize limits call for. The processor resizes every image to
        sides that are multiples of ``patch_size * merge_size`` with ``min_pixels <= h*w <=
        max_pixels``, so one image has between ceil(min/patch**2) and floor(max/patch**2) patches,
        in whole merge blocks; ``opt`` and ``max`` are one image at the maximum (a call is one
        image, and large images are where the engine's time goes)."""
        block = merge_size * merge_size
        pixels_per_patch = patch_size * patch_size
        smallest = -(-min_pixels // pixels_per_patch)
        smallest = max(block, -(-smallest // block) * block)
        largest = max_pixels // pixels_per_patch // block * block
        if largest < smallest:
            raise ValueError(f"max_pixels {max_pixels} is below min_pixels {min_pixels} at patch size {patch_size}")
        return cls(min_patches=smallest, opt_patches=largest, max_patches=largest)

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any]) -> TrtProfile:
        """:meth:`from_pixel_limits` with a checkpoint's ``preprocessor_config.json`` (its
        ``min_pixels``/``max_pixels``, or ``size.shortest_edge``/``longest_edge`` as transformers 5
        writes them)."""
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels") or size.get("shortest_edge")
        max_pixels = config.get("max_pixels") or size.get("longest_edge")
        if not min_pixels or not max_pixels:
            raise ValueError("preprocessor_config.json gives no min_pixels/max_pixels (or size.shortest/longest_edge)")
        return cls.from_pixel_limits(
            int(min_pixels), int(max_pixels), int(config.get("patch_size", 14)), int(config.get("merge_size", 2))
        )

    def engine_shapes(self, patches: int, image_patch_dim: int) -> dict[str, SizedShape]:
        """The engine's input shapes for one image of ``patches`` patches: one frame of folded
        rows, as the gpu target serves images only (no video on epd) and preprocess sends an
        image's equal temporal copies once."""
        return {contract.PIXEL_VALUES: (1, patches, image_patch_dim), contract.ROTARY_POS_IDS: (patches, 2)}

    def input_shapes(self, image_patch_dim: int) -> dict[str, ShapeRange]:
        """(min, opt, max) engine shape of each input (``build_tensorrt_plan``'s profile): frames
        and row width fixed (1, ``image_patch_dim``), patches from min to max. ValueError for a
        profile :meth:`validate` refuses."""
        self.validate()
        low, opt, high = (
            self.engine_shapes(n, image_patch_dim) for n in (self.min_patches, self.opt_patches, self.max_patches)
        )
        return {name: (low[name], opt[name], high[name]) for name in low}

    def parameters(self) -> dict[str, int]:
        return {
            contract.PROFILE_MIN_PATCHES: self.min_patches,
            contract.PROFILE_OPT_PATCHES: self.opt_patches,
            contract.PROFILE_MAX_PATCHES: self.max_patches,
        }


def cuda_graph_shapes(
    profile: TrtProfile, image_patch_dim: int, graph_patches: Sequence[int] | None = None
) -> list[dict[str, SizedShape]]:
    """Engine input shapes of each CUDA graph: one image of ``patches`` patches (by default the
    profile's opt and max, one graph where they are equal)."""
    profile.validate()
    patches_list = sorted(set(graph_patches or (profile.opt_patches, profile.max_patches)))
    for patches in patches_list:
        if not profile.min_patches <= patches <= profile.max_patches:
            raise ValueError(f"CUDA graph at {patches} patches is outside the profile {profile}")
    return [profile.engine_shapes(patches, image_patch_dim) for patches in patches_list]


@dataclass(frozen=True)
class AudioTrtProfile:
    """The audio encoder plan's one optimisation profile. Whisper's feature extractor pads every
    clip to its window (``mel_bins`` x ``frames``: 128 x 3000 for 30 s), so only the clip count
    varies: 1 to ``max_clips`` (the target's ``max_audios``, a request's clips), optimised for the
    one clip ``encoder_<i>`` sends a call (python_backends/encode/audios.py)."""

    mel_bins: int
    frames: int
    max_clips: int = contract.default_of(contract.PROFILE_MAX_CLIPS)
    opt_clips: int = 1

    def validate(self) -> None:
        if min(self.mel_bins, self.frames) <= 0:
            raise ValueError(f"mel bins and frames must be positive, got {self}")
        if not 0 < self.opt_clips <= self.max_clips:
            raise ValueError(f"need 0 < opt_clips <= max_clips, got {self}")

    def _shapes(self, clips: int) -> dict[str, SizedShape]:
        return {contract.INPUT_FEATURES: (clips, self.mel_bins, self.frames), contract.FEATURE_LENGTHS: (clips,)}

    def input_shapes(self) -> dict[str, ShapeRange]:
        """(min, opt, max) engine shape of each input (``build_tensorrt_plan``'s profile)."""
        self.validate()
        low, opt, high = self._shapes(1), self._shapes(self.opt_clips), self._shapes(self.max_clips)
        return {name: (low[name], opt[name], high[name]) for name in low}

    def graph_shapes(self) -> list[dict[str, SizedShape]]:
        """Engine input shapes of the CUDA graph: one clip, what every ``encoder_<i>`` call is. The
        clip's length is a value (the graph masks by it), not a shape, so one graph serves all."""
        self.validate()
        return [self._shapes(1)]

    def parameters(self) -> dict[str, int]:
        return {contract.PROFILE_MAX_CLIPS: self.max_clips}


def _graph_spec(shapes: dict[str, SizedShape]) -> str:
    lines = [f'        input {{ key: "{name}" value {{ dim: {render_dims(dims)} }} }}' for name, dims in shapes.items()]
    return "      {\n" + "\n".join(lines) + "\n      }"


def _plan_config(
    target_name: str,
    interface: contract.ModelInterface,
    about: str,
    graphs: Sequence[dict[str, SizedShape]],
    parameters: dict[str, Any],
    instances: int,
    gpu: int,
) -> str:
    """A plan's config.pbtxt (``tensorrt_plan.pbtxt``): ``interface``'s sized tensors, CUDA graphs
    for ``graphs`` (engine dims), ``about`` a comment line on what one request is."""
    return render_template(
        "tensorrt_plan.pbtxt",
        {
            "target": target_name,
            "about": about,
            "name": interface.name,
            "platform": "tensorrt_plan",
            # The leading dimension is the engine's own (patches, clips), not Triton's batch.
            "max_batch_size": "0",
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            # Only on the encode side's GPU: without ``gpus`` Triton puts ``count`` instances on every GPU.
            "instance_group": f"  {{ count: {instances} kind: KIND_GPU gpus: [ {gpu} ] }}",
            "cuda_graphs": "true",
            "graph_spec": ",\n".join(_graph_spec(shapes) for shapes in graphs),
            "parameters": render_parameters(parameters),
        },
    )


def tensorrt_config(
    target_name: str,
    facts: dict[str, Any],
    profile: TrtProfile,
    precision: str,
    instances: int,
    gpu: int = 0,
) -> str:
    """``vit_encoder/config.pbtxt`` for the plan. ``facts``: the exported encoder's
    (``EncoderFacts``), written as parameters too (checked at load, shown as metrics)."""
    return _plan_config(
        target_name,
        contract.VIT_ENCODER_TENSORRT.sized(facts),
        "One image per request: [1 frame, patches, folded rows] in, [1, tokens, hidden] out.",
        cuda_graph_shapes(profile, facts[contract.IMAGE_PATCH_DIM]),
        {**profile.parameters(), contract.PRECISION: precision, **facts},
        instances,
        gpu,
    )


def audio_tensorrt_config(
    target_name: str, profile: AudioTrtProfile, precision: str, instances: int, gpu: int = 0
) -> str:
    """``audio_encoder/config.pbtxt`` for the plan: the cpu model's tensors (Triton's TensorRT
    backend takes a config's -1 as a wildcard for the engine's fixed mel bins, frames and padded
    tokens), its profile and precision as parameters (shown, not read)."""
    return _plan_config(
        target_name,
        contract.AUDIO_ENCODER_TENSORRT,
        "Clips per request, each padded to the feature window; encoder_<i> sends one.",
        profile.graph_shapes(),
        {**profile.parameters(), contract.PRECISION: precision},
        instances,
        gpu,
    )
