"""Hardware profiles: the stage service times the simulator is fed with, read from JSON.

A profile says what each unit of work costs on one kind of machine: an encoder per image patch,
an engine step per prefill token and per running sequence, the BLS per request and per relayed
token, the transfers. ``shared_cpu_slots`` set means every stage runs on the same CPU cores
(this 2-core machine: encoder, engines and Python frontends compete); unset means each instance
owns its device (one GPU per instance). Every number in a shipped profile says where it comes
from in the file's ``sources`` (measured here, or a published number with its URL).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile file that cannot be used, with what to fix."""


@dataclass(frozen=True)
class VisionSpec:
    """How an image becomes patches and tokens (Qwen2-VL ``smart_resize``)."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448

    def patches(self, width: int, height: int) -> int:
        """Vision-tower patches for one image of this size, as Qwen2-VL's processor resizes it."""
        factor = self.patch_size * self.merge_size
        h = max(factor, round(height / factor) * factor)
        w = max(factor, round(width / factor) * factor)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return (h // self.patch_size) * (w // self.patch_size)

    def tokens(self, width: int, height: int) -> int:
        """LLM placeholder tokens for one image (patches merged merge_size x merge_size)."""
        return self.patches(width, height) // (self.merge_size**2)


@dataclass(frozen=True)
class EngineCosts:
    """One vLLM-like engine step: base + per prefill token + per decoding sequence (+ in-engine ViT)."""

    step_base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    vit_ms_per_patch: float = 0.0
    max_batched_tokens: int = 8192
    # CPU its idle worker threads burn after each step (OpenMP spin-wait): off the path, but it competes.
    spin_ms_per_step: float = 0.0
    # The share of a repeated image's vision-tower work the engine still does (vLLM's encoder cache
    # keeps only recent items): 0 (the default) skips it entirely, 1 encodes it again.
    vit_hit_share: float = 0.0

    def step_ms(self, prefill_tokens: int, decode_seqs: int, vit_patches: int = 0) -> float:
        return (
            self.step_base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_seq * decode_seqs
            + self.vit_ms_per_patch * vit_patches
        )


@dataclass(frozen=True)
class EncoderCosts:
    """A standalone encoder (preprocess + vision tower) per image; ``threads`` cores in parallel on CPU."""

    base_ms: float
    ms_per_patch: float
    threads: int = 1
    # CPU each of its threads burns spinning after an image (ONNX Runtime / DALI thread pools).
    spin_ms: float = 0.0
    # Once per request: its missing images go in one call (one DALI run, one ONNX Runtime run), so a
    # request with one new image pays what four share (the reuse workload, docs/benchmarks/advisor.md).
    call_ms: float = 0.0

    def image_ms(self, patches: int) -> float:
        return self.base_ms + self.ms_per_patch * patches


@dataclass(frozen=True)
class FrontendCosts:
    """The serving model's Python side (colocated ``llm`` or the ``epd`` BLS), one request at a time.

    ``request_ms``: per request (hash, lookup, hops, input parsing); ``media_ms_per_patch``: media
    preprocessing done here before the engine (colocated: the HF image processor); ``relay_ms_per_step``
    + ``relay_ms_per_token``: forwarding one engine step's tokens to the clients; ``hit_ms``: a store or
    cache lookup that hits.
    """

    request_ms: float
    relay_ms_per_token: float
    relay_ms_per_step: float = 0.0
    media_base_ms: float = 0.0
    media_ms_per_patch: float = 0.0
    hit_ms: float = 0.0


CPU_ROLES = ("colocated", "encoder", "pd")  # Profile.cpu_sets' roles


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    vision: VisionSpec
    colocated_engine: EngineCosts
    colocated_frontend: FrontendCosts
    encoder: EncoderCosts
    prefill_engine: EngineCosts
    decode_engine: EngineCosts
    disaggregated_frontend: FrontendCosts
    # Per token moved between stages (embeddings E->P, KV P->D), as pure delay (a copy engine or NIC).
    embedding_transfer_ms_per_token: float = 0.0
    kv_transfer_ms_per_token: float = 0.0
    # A repeated image also skips the LLM's prefill of its tokens (vLLM prefix caching keys blocks by mm_hash).
    hit_skips_image_prefill: bool = True
    shared_cpu_slots: int | None = None
    # Each role on CPUs of its own (``--cpus``, docs/benchmarks/epd-pays.md): role -> core ids, the
    # roles ``colocated`` (llm: its engine and stub), ``encoder`` (preprocess + vision tower) and
    # ``pd`` (epd's stub with its engine, prefill, decode). A layout runs alone (as the bench's
    # modes do), so ``colocated`` may take any cores; ``encoder`` and ``pd`` share their cores when
    # their sets are equal and must not overlap otherwise. Empty: ``shared_cpu_slots`` decides.
    cpu_sets: dict[str, list[int]] = field(default_factory=dict)
    # The PD engine of an xE+yPD layout runs in the frontend's process (epd's own engine fed the
    # encoders' embeddings, our E|PD) and its chunks are relayed as ``colocated_frontend`` relays
    # them; False: a PD worker with its own stub, as vLLM's 1E+1PD.
    pd_in_frontend: bool = False
    time_slice_ms: float = 2.0
    # True: spinning threads (OpenMP, encoder thread pools) only take cores nobody waits for, so spin
    # fades as load grows; False: they compete like any other work.
    spin_yields: bool = False
    # Coefficient of variation of every service time (lognormal, mean 1): spreads p50 from p90.
    service_cv: float = 0.0
    # GPU profiles: how many devices the advisor lays out by default (one instance per device).
    devices: int | None = None
    # The workload the profile was measured or sourced with (prompt_tokens counts the chat template).
    default_workload: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        try:
            parts = {
                "vision": VisionSpec(**data.get("vision", {})),
                "colocated_engine": EngineCosts(**data["colocated_engine"]),
                "colocated_frontend": FrontendCosts(**data["colocated_frontend"]),
                "encoder": EncoderCosts(**data["encoder"]),
                "prefill_engine": EngineCosts(**data["prefill_engine"]),
                "decode_engine": EngineCosts(**data["decode_engine"]),
                "disaggregated_frontend": FrontendCosts(**data["disaggregated_frontend"]),
            }
            rest = {k: v for k, v in data.items() if k not in parts and not k.startswith("_")}
            profile = cls(**parts, **rest)
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"profile is missing or has an unknown field: {exc}") from exc
        if profile.shared_cpu_slots is not None and profile.shared_cpu_slots < 1:
            raise ProfileError("shared_cpu_slots must be >= 1 (or null for one device per instance)")
        if profile.cpu_sets:
            sets = {role: frozenset(cores) for role, cores in profile.cpu_sets.items()}
            if set(sets) != set(CPU_ROLES) or not all(sets.values()):
                raise ProfileError(f"cpu_sets needs a non-empty core list for each of {', '.join(CPU_ROLES)}")
            encoder, pd = sets["encoder"], sets["pd"]
            if encoder != pd and encoder & pd:
                raise ProfileError(
                    "encoder and pd sets overlapping in part are not modelled: make them equal or disjoint"
                )
        return profile

    def replace(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, **changes)


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``cpu-2core``, ``gpu-a100``) or any profile JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ProfileError(f"no profile {name_or_path!r}: give a JSON path or one of: {shipped}")
    return Profile.from_json(json.loads(path.read_text()))


def save_profile(profile: Profile, path: Path) -> None:
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
