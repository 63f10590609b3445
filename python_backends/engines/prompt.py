"""vLLM's prompt, built in one place: text or token ids, ``multi_modal_data``, ``multi_modal_uuids``.

Who calls it: ``engines/llm.py`` (``llm``: media or the client's embeddings, videos),
``epd/colocated.py`` (media with their content keys, or stored embeddings), and
``pd/engines.py`` + ``pd/kv_transfer.py`` (``prefill``/``decode``: stored embeddings, token ids).
It also holds the form the store's embeddings take as engine input (:class:`ImageEmbeds`,
:func:`stored_embeds`, one copy out of the store by :func:`owned_float32`).

Two forms of a multimodal item reach vLLM: media (a PIL image, a loaded video, or ``None`` for
an item vLLM's processor cache holds under its uuid) or precomputed embeddings (vLLM's
``enable_mm_embeds``: ``<modality>_embeds`` + ``<modality>_grid_thw`` per modality). vLLM takes
one form per modality in a prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from python_backends.store.device_memory import DeviceView

if TYPE_CHECKING:
    import torch

    from python_backends.store import EmbeddingStore, Reference


@dataclass(frozen=True)
class ImageEmbeds:
    """One image's (or video's) precomputed embeddings, as the encoder produced them."""

    embeds: torch.Tensor  # [num_tokens, hidden] (num_tokens = t*h*w / merge**2; audio: the clip's tokens)
    grid_thw: tuple[int, int, int] | tuple[()]  # () for audio
    # A stable identity of these embeddings (the store's content key), given to vLLM as
    # ``multi_modal_uuids``. Needed across processes: vLLM 0.32 hashes an embeddings item
    # as a dict whose key order follows a set (Python's per-process hash seed), so the
    # prefill and decode processes can compute different hashes for the same tensors and
    # the connector then refuses the transfer ("multimodal inputs differ"). Measured: 2 of
    # 4 server starts. Empty: let vLLM hash (fine within one process).
    uuid: str = ""
    # "image", "video" (a video's embeddings: its frames' tokens, grid t = frames / 2) or "audio".
    modality: str = "image"


def _by_modality(items: Sequence[ImageEmbeds]) -> dict[str, list[ImageEmbeds]]:
    groups: dict[str, list[ImageEmbeds]] = {}
    for item in items:
        groups.setdefault(item.modality, []).append(item)
    return groups


def multi_modal_data(items: Sequence[ImageEmbeds]) -> dict[str, Any] | None:
    """vLLM's ``enable_mm_embeds`` input per modality: embeddings concatenated, grids stacked
    (``image_embeds`` + ``image_grid_thw``, ``video_embeds`` + ``video_grid_thw``), each
    modality's items in their prompt order; audio (Qwen2-Audio): ``audio_embeds``, one
    ``[tokens, hidden]`` tensor per clip (clips differ in length, and there is no grid)."""
    if not items:
        return None
    import torch

    data: dict[str, Any] = {}
    for modality, group in _by_modality(items).items():
        if modality == "audio":
            data[modality] = {"audio_embeds": [item.embeds for item in group]}
            continue
        embeds = torch.cat([item.embeds for item in group], dim=0)
        grids = torch.tensor([list(item.grid_thw) for item in group], dtype=torch.int64)
        data[modality] = {f"{modality}_embeds": embeds, f"{modality}_grid_thw": grids}
    return data


def multi_modal_uuids(items: Sequence[ImageEmbeds]) -> dict[str, Any] | None:
    """vLLM's ``multi_modal_uuids`` when every item has an identity, else None."""
    if not items or not all(item.uuid for item in items):
        return None
    return {modality: [item.uuid for item in group] for modality, group in _by_modality(items).items()}


def vllm_prompt(
    prompt: str | Sequence[int],
    embeds: Sequence[ImageEmbeds] = (),
    mm_data: Mapping[str, Any] | None = None,
    mm_uuids: Mapping[str, list[str]] | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """vLLM's input for one request.

    ``prompt``: text, or token ids (decode's prefilled prompt). ``embeds``: stored embeddings
    (with their identities when every item has one). ``mm_data`` / ``mm_uuids``: items given in
    vLLM's form as they are (media per modality, ``None`` for an item the engine holds, or a
    client's embeddings already in ``enable_mm_embeds`` form). ``cache_salt`` (vLLM's) keeps the
    request off prefix-cache entries of other salts.
    """
    vllm_input: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
    data = {**(mm_data or {}), **(multi_modal_data(embeds) or {})}
    if data:
        vllm_input["multi_modal_data"] = data
        uuids = {**(mm_uuids or {}), **(multi_modal_uuids(embeds) or {})}
        if uuids:
            vllm_input["multi_modal_uuids"] = uuids
    if cache_salt:
        vllm_input["cache_salt"] = cache_salt
    return vllm_input


def stored_embeds(store: EmbeddingStore, ref: Reference) -> ImageEmbeds:
    """The engine's copy of one stored embedding, its content key as its vLLM identity."""
    with store.open_view(ref) as view:
        tensor = owned_float32(view, ref.dtype)
    return ImageEmbeds(tensor, tuple(ref.grid_thw or ()), uuid=ref.key, modality=ref.modality)  # type: ignore[arg-type]


def owned_float32(view: np.ndarray | DeviceView, dtype: str) -> Any:
    """A float32 torch tensor the engine may keep after the view closes, on the view's device:
    the one copy out of the store. ``bfloat16`` entries are stored as uint16 bit patterns (the
    high half of a float32): widened in that same copy, not converted twice.

    Not zero-copy on purpose: vLLM keeps multimodal inputs and encoder outputs (its encoder and
    processor caches) beyond one request, and a view is only valid while it is open (the store
    may evict and reuse the bytes afterwards), so handing vLLM the view itself could later feed
    it another entry's bytes."""
    import torch

    if isinstance(view, DeviceView):
        shared = torch.as_tensor(view, device="cuda")  # the store's memory, no copy
        if dtype == "bfloat16":
            shared = shared.view(torch.bfloat16)
        return shared.to(torch.float32, copy=True)
    host = np.asarray(view)
    if dtype != "bfloat16":
        return torch.from_numpy(host.astype(np.float32))  # astype copies, from_numpy shares it
    bits = host.astype(np.uint32)
    bits <<= 16
    return torch.from_numpy(bits.view(np.float32))
