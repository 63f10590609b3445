"""The Triton edge of the EPD stages: BLS calls from ``epd`` and the stage models' wire format.

Like ``triton_edge.py``, this module imports ``triton_python_backend_utils`` and so runs
only inside a python-backend stub; the logic it serves (``epd_pipeline.py``,
``pd_stage.py``) is plain Python.

BLS calls are made with the synchronous ``InferenceRequest.exec`` on a dedicated thread
pool (one thread per call in flight), so the ``epd`` event loop never blocks and a
streaming ``decode`` does not hold a thread of asyncio's small default pool. Triton 2.51's
python backend cannot cancel a BLS request, so :meth:`BlsStages.abort_decode` sends
``decode`` a control request (``abort`` = true, same ``request_id``) instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.cached_encoder import EncodedImage
from python_backends.epd_pipeline import DecodeOutput, EpdChunk, PrefillOutput
from python_backends.errors import EpdError, ErrorCode
from python_backends.triton_edge import ERROR_OUTPUT, ERRORS_AS_OUTPUTS, bytes_tensor, chunk_response


def _code_of(error: pb_utils.TritonError) -> ErrorCode:
    # Looked up per call: pb_utils.TritonError does not exist yet when the stub imports model.py
    # for auto-complete.
    for code in (ErrorCode.INVALID_ARG, ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED):
        if error.code() == getattr(pb_utils.TritonError, code.value):
            return code
    return ErrorCode.INTERNAL


def _checked(response: pb_utils.InferenceResponse, model: str) -> dict[str, np.ndarray]:
    if response.has_error():
        error = response.error()
        raise EpdError(error.message(), _code_of(error))
    outputs = {t.name(): _array_of(t) for t in response.output_tensors()}
    if ERROR_OUTPUT in outputs:  # a stage's error, as we asked for it (triton_edge)
        payload = json.loads(_text(outputs[ERROR_OUTPUT]))
        raise EpdError(str(payload["message"]), ErrorCode(payload["code"]))
    return outputs


def _array_of(tensor: pb_utils.Tensor) -> Any:
    """numpy for host tensors; a torch CUDA tensor (no copy, via DLPack) for device ones, as the
    gpu target's TensorRT encoder returns: the encoder model stores it with one device copy."""
    if tensor.is_cpu():
        return tensor.as_numpy()
    import torch  # noqa: PLC0415 - only GPU outputs need it

    return torch.from_dlpack(tensor.to_dlpack())


def _text(array: np.ndarray | None) -> str:
    if array is None or array.size == 0:
        return ""
    return "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.reshape(-1))


def _int(array: np.ndarray | None, default: int = 0) -> int:
    return default if array is None or array.size == 0 else int(array.reshape(-1)[0])


class BlsCaller:
    """BLS calls on a dedicated thread pool (one thread per call in flight)."""

    def __init__(self, max_threads: int = 256) -> None:
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="epd-bls")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _stream(self, model: str, inputs: list[pb_utils.Tensor]) -> AsyncIterator[dict[str, np.ndarray]]:
        async def responses() -> AsyncIterator[dict[str, np.ndarray]]:
            flag = pb_utils.Tensor(ERRORS_AS_OUTPUTS, np.array([True], dtype=bool))
            request = pb_utils.InferenceRequest(model_name=model, inputs=[*inputs, flag], requested_output_names=[])
            iterator = await self._call(lambda: iter(request.exec(decoupled=True)))
            while True:
                response = await self._call(next, iterator, None)
                if response is None:
                    return
                out = _checked(response, model)
                if out:
                    yield out

        return responses()


class BlsEncode(BlsCaller):
    """One image through the ``encode`` ensemble, embeddings by value (inside an encoder
    model, which writes them into the store)."""

    def __init__(self, encode_model: str, max_threads: int = 64) -> None:
        super().__init__(max_threads)
        self.encode_model = encode_model

    async def __call__(self, image: bytes) -> EncodedImage:
        request = pb_utils.InferenceRequest(
            model_name=self.encode_model,
            inputs=[pb_utils.Tensor("image", np.frombuffer(image, dtype=np.uint8)[None].copy())],
            requested_output_names=["image_embeds", "image_grid_thw"],
        )
        out = _checked(await self._call(request.exec), self.encode_model)
        embeds = out["image_embeds"]
        grid = out["image_grid_thw"].reshape(-1)
        return EncodedImage(embeds.reshape(-1, embeds.shape[-1]), (int(grid[0]), int(grid[1]), int(grid[2])))


class BlsStages(BlsCaller):
    """:class:`python_backends.epd_pipeline.StageClient` over BLS (inside ``epd`` only)."""

    def __init__(self, prefill_model: str, decode_model: str, max_threads: int = 256) -> None:
        super().__init__(max_threads)
        self.prefill_model = prefill_model
        self.decode_model = decode_model

    async def encode_reference(self, encoder: str, image: bytes, lease_owner: int) -> tuple[bytes, bool]:
        inputs = [
            bytes_tensor("image", [image]),
            pb_utils.Tensor("lease_owner", np.array([lease_owner], dtype=np.int64)),
        ]
        out: dict[str, np.ndarray] | None = None
        async for response in self._stream(encoder, inputs):
            out = response
        if out is None:
            raise EpdError(f"{encoder} returned no response", ErrorCode.INTERNAL)
        return bytes(out["references"].reshape(-1)[0]), bool(out["cache_hit"].reshape(-1)[0])

    async def prefill(self, prompt: str, references: Sequence[bytes], sampling: Mapping[str, Any]) -> PrefillOutput:
        inputs = [
            bytes_tensor("text_input", [prompt]),
            bytes_tensor("sampling_parameters", [json.dumps(dict(sampling))]),
        ]
        if references:
            inputs.append(bytes_tensor("references", list(references)))
        result: dict[str, np.ndarray] | None = None
        async for out in self._stream(self.prefill_model, inputs):
            result = out
        if result is None:
            raise EpdError("prefill returned no response", ErrorCode.INTERNAL)
        return PrefillOutput(
            token_ids=[int(t) for t in result["output_token_ids"].reshape(-1)],
            text=_text(result.get("text_output")),
            num_input_tokens=_int(result.get("num_input_tokens")),
            finish_reason=_text(result.get("finish_reason")) or None,
            transfer_params=_text(result.get("transfer_params")),
        )

    async def decode(
        self,
        request_id: str,
        references: Sequence[bytes],
        transfer_params: str,
        sampling: Mapping[str, Any],
        stream: bool,
    ) -> AsyncIterator[DecodeOutput]:
        inputs = [
            bytes_tensor("request_id", [request_id]),
            bytes_tensor("transfer_params", [transfer_params]),
            bytes_tensor("sampling_parameters", [json.dumps(dict(sampling))]),
            pb_utils.Tensor("stream", np.array([stream], dtype=bool)),
        ]
        if references:
            inputs.append(bytes_tensor("references", list(references)))
        async for out in self._stream(self.decode_model, inputs):
            reason = _text(out.get("finish_reason")) or None
            yield DecodeOutput(
                token_ids=[int(t) for t in out["output_token_ids"].reshape(-1)],
                text=_text(out.get("text_output")),
                num_output_tokens=_int(out.get("num_output_tokens")),
                finish_reason=reason,
                finished=reason is not None,
            )

    async def abort_decode(self, request_id: str) -> None:
        inputs = [bytes_tensor("request_id", [request_id]), pb_utils.Tensor("abort", np.array([True], dtype=bool))]
        async for _ in self._stream(self.decode_model, inputs):
            pass

    async def discard_transfer(self, transfer_params: str) -> None:
        inputs = [
            bytes_tensor("transfer_params", [transfer_params]),
            pb_utils.Tensor("abort", np.array([True], dtype=bool)),
        ]
        async for _ in self._stream(self.decode_model, inputs):
            pass


def epd_response(item: EpdChunk) -> pb_utils.InferenceResponse:
    """A generation chunk plus, when measured, ``timing_<stage>_ms`` and ``cache_hits``."""
    response = chunk_response(item.chunk)
    tensors = list(response.output_tensors())
    if item.timings_ms:
        tensors += [
            pb_utils.Tensor(f"timing_{stage}_ms", np.array([value], dtype=np.float32))
            for stage, value in item.timings_ms.items()
        ]
        tensors.append(pb_utils.Tensor("cache_hits", np.array([item.cache_hits], dtype=np.uint32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)
