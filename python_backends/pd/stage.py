"""Request parsing of the ``prefill`` and ``decode`` models and their images (Triton-free).

Both take the prompt's images as **references** (``references``: BYTES [n], one signed
reference per image, see ``store/reference.py``), never as media: their configs have no
image input, so Triton itself refuses media. References are checked and read from the
node's embedding store here (INVALID_ARG when malformed or tampered, NOT_FOUND when unknown
or evicted) before any engine work.

Reading (``engines/prompt.py``, :func:`stored_embeds`): the view into the store (its memory
map on cpu, its CUDA block on gpu) is copied once into the engine's input tensor, on the view's
device. Not zero-copy on purpose: vLLM keeps multimodal inputs and encoder outputs (its encoder
and processor caches) beyond one request, and a view is only valid while it is open (the store
may evict and reuse the bytes afterwards), so handing vLLM the view itself could later feed it
another entry's bytes. One memcpy of a few hundred KB per image; no Triton transfer, no
serialization, no decode of media.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.engines.prompt import ImageEmbeds, stored_embeds
from python_backends.errors import invalid_arg
from python_backends.request.sampling import SamplingLimits, parse_sampling_parameters
from python_backends.store import EmbeddingStore, Reference


@dataclass(frozen=True)
class StageInputs:
    references: list[bytes]
    sampling: dict[str, Any]
    text: str = ""
    transfer_params: str = ""
    request_id: str = ""
    stream: bool = True
    abort: bool = False
    poll_offset: int | None = None  # decode, polled (pd/polling.py); None: stream the tokens


def _strings(array: np.ndarray | None) -> list[bytes]:
    if array is None:
        return []
    if array.dtype != np.object_:
        raise invalid_arg("string inputs must be BYTES")
    return [bytes(x) if isinstance(x, (bytes, np.bytes_)) else str(x).encode() for x in array.reshape(-1)]


def _one_text(inputs: Mapping[str, np.ndarray], name: str) -> str:
    values = _strings(inputs.get(name))
    if len(values) > 1:
        raise invalid_arg(f"input '{name}' must hold one element")
    try:
        return values[0].decode("utf-8") if values else ""
    except UnicodeDecodeError:
        raise invalid_arg(f"input '{name}' is not valid UTF-8") from None


def _flag(inputs: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    array = inputs.get(name)
    return default if array is None or array.size == 0 else bool(array.reshape(-1)[0])


def parse_stage_inputs(inputs: Mapping[str, np.ndarray], limits: SamplingLimits) -> StageInputs:
    """``sampling`` as ``epd`` sent it: the request's, the checkpoint's defaults already merged in."""
    return StageInputs(
        references=_strings(inputs.get(contract.REFERENCES)),
        sampling=parse_sampling_parameters(_one_text(inputs, contract.SAMPLING_PARAMETERS) or None, limits),
        text=_one_text(inputs, contract.TEXT_INPUT),
        transfer_params=_one_text(inputs, contract.TRANSFER_PARAMS),
        request_id=_one_text(inputs, contract.REQUEST_ID),
        stream=_flag(inputs, contract.STREAM, True),
        abort=_flag(inputs, contract.ABORT, False),
        poll_offset=_offset(inputs.get(contract.POLL_OFFSET)),
    )


def _offset(array: np.ndarray | None) -> int | None:
    if array is None:
        return None
    if array.size != 1 or array.dtype != np.int64 or int(array.reshape(-1)[0]) < 0:
        raise invalid_arg(f"input '{contract.POLL_OFFSET}' must be one INT64 >= 0")
    return int(array.reshape(-1)[0])


def resolve_images(store: EmbeddingStore, references: list[bytes]) -> tuple[list[ImageEmbeds], list[Reference]]:
    """The embeddings the references name, checked against the store, as engine inputs."""

    images: list[ImageEmbeds] = []
    refs: list[Reference] = []
    for index, raw in enumerate(references):
        ref = store.parse_reference(raw)
        if (ref.modality == "audio") != (ref.grid_thw is None):  # audio has no grid, images and videos one
            raise invalid_arg(f"reference {index} is not an image or video embedding with a grid, nor an audio one")
        # One copy out of the store; the content key is the item's identity for vLLM (see ImageEmbeds.uuid).
        images.append(stored_embeds(store, ref))
        refs.append(ref)
    return images, refs

