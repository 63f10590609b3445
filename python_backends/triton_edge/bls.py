"""The stage calls ``epd`` and the encoder models make over BLS.

Calls use the synchronous ``InferenceRequest.exec`` on a dedicated thread pool (one thread per
call in flight), so the caller's event loop never blocks and a streaming ``decode`` does not
hold a thread of asyncio's small default pool. Triton 2.51's python backend cannot cancel a
BLS request, so :meth:`BlsStages.abort_decode` sends ``decode`` a control request (``abort`` =
true, same ``request_id``) instead.

Finished iterators are kept for a while (``RETIRE_S``) before Python lets go of them: see
:meth:`BlsCaller._retire`.

Errors: every decoupled stage is called with ``errors_as_outputs`` and answers its errors in the
``error`` output (why: ``responses.py``). A Triton error on a BLS response is then only Triton's
own (model missing, inputs refused by the config) or the non-decoupled ``encode`` ensemble's;
both are read with their code.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends import contract
from python_backends.encode.cached import EncodedImage, split_encoded
from python_backends.engines.generation import GenerationChunk, chunk_from_outputs, int_of, text_of
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.tenants import tenant_parameter
from python_backends.runtime.model_params import ModelParameters
from python_backends.triton_edge.responses import bytes_tensor, error_from_output, tensor


def _code_of(error: pb_utils.TritonError) -> ErrorCode:
    # Looked up per call: pb_utils.TritonError does not exist yet when the stub imports model.py
    # for auto-complete.
    for code in (ErrorCode.INVALID_ARG, ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED):
        if error.code() == getattr(pb_utils.TritonError, code.value):
            return code
    return ErrorCode.INTERNAL


def _outputs(response: pb_utils.InferenceResponse) -> dict[str, Any]:
    """A BLS response's outputs by name, or its error (either kind) raised as an EpdError."""
    if response.has_error():
        error = response.error()
        raise EpdError(error.message(), _code_of(error))
    outputs = {t.name(): _array_of(t) for t in response.output_tensors()}
    if contract.ERROR in outputs:
        raise error_from_output(text_of(outputs[contract.ERROR]))
    return outputs


def _array_of(output: pb_utils.Tensor) -> Any:
    """numpy for host tensors; a torch CUDA tensor (no copy, via DLPack) for device ones, as the
    gpu target's TensorRT encoder returns: the encoder model stores it with one device copy."""
    if output.is_cpu():
        return output.as_numpy()
    import torch  # only GPU outputs need it

    return torch.from_dlpack(output.to_dlpack())


# How long a finished BLS response iterator is kept (see BlsCaller._retire): the stub's own
# reference goes within milliseconds of the final response, or as long as its stub-to-parent
# thread is behind (each message there is a round trip to the server).
RETIRE_S = 10.0


class BlsCaller:
    """BLS calls on a dedicated thread pool (one thread per call in flight)."""

    def __init__(self, max_threads: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="epd-bls")
        self._open_streams = 0  # response iterators not yet read to their final response
        self._open_lock = threading.Lock()
        self._clock = clock
        self._retired: deque[tuple[float, Any]] = deque()  # (finished at, iterator), oldest first

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def open_streams(self) -> int:
        """BLS response streams opened and not yet read to their final response: 0 whenever no
        request runs (a left-over one holds up the model's unload, see :meth:`_read_to_final_after`)."""
        with self._open_lock:
            return self._open_streams

    def _open(self, request: pb_utils.InferenceRequest) -> Iterator[Any]:
        iterator = iter(request.exec(decoupled=True))
        with self._open_lock:
            self._open_streams += 1
        return iterator

    def _next(self, iterator: Iterator[Any]) -> Any:
        """The stream's next response, or None after its final one (then the stream is closed)."""
        response = next(iterator, None)
        if response is None:
            with self._open_lock:
                self._open_streams -= 1
            self._retire(iterator)
        return response

    def _retire(self, iterator: Iterator[Any]) -> None:
        """Keep a finished iterator for ``RETIRE_S``, and let go of those kept longer.

        Why: Triton 2.51's stub (python_backend ``pb_response_iterator.cc`` and ``pb_stub.cc``
        ``SendCleanupId``, unchanged upstream as of 2026-07) also holds each iterator in a map until
        its stub-to-parent thread erases it after the final response, without the GIL. Were
        Python's reference gone by then, that erase would destroy the iterator there, and with it
        every response it read and their numpy outputs: Python objects freed without the GIL,
        which corrupts Python's allocator (the epd stub's ``pymalloc_alloc`` segfault and
        ``malloc_consolidate`` abort on 2026-12-02, docs/benchmarks/bls-release.md). Kept here, the
        last reference is Python's, dropped by a pool thread that holds the GIL."""
        now = self._clock()
        expired = []
        with self._open_lock:
            self._retired.append((now, iterator))
            while self._retired and now - self._retired[0][0] >= RETIRE_S:
                expired.append(self._retired.popleft()[1])
        del expired  # destroyed here, on this thread, outside the lock

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @staticmethod
    def _request(
        model: str, inputs: list[pb_utils.Tensor], parameters: Mapping[str, str] | None
    ) -> pb_utils.InferenceRequest:
        """A request to a decoupled stage, which answers its errors in the ``error`` output.
        ``parameters``: Triton request parameters for the stage (e.g. the tenant)."""
        flag = tensor(contract.ERRORS_AS_OUTPUTS, [True], bool)
        extra = {"parameters": dict(parameters)} if parameters else {}
        return pb_utils.InferenceRequest(model_name=model, inputs=[*inputs, flag], requested_output_names=[], **extra)

    def _read_whole(self, request: pb_utils.InferenceRequest) -> list[Any]:
        """Send ``request`` and read its stream to the final response, on one pool thread."""
        iterator = self._open(request)
        responses = []
        while (response := self._next(iterator)) is not None:
            responses.append(response)
        return responses

    async def _stream(
        self, model: str, inputs: list[pb_utils.Tensor], parameters: Mapping[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """A decoupled stage's non-empty responses (the empty final one is not yielded), read one
        at a time (only the measurement-only streamed decode read does this)."""
        opening = self._pool.submit(self._open, self._request(model, inputs, parameters))
        try:
            iterator = await asyncio.wrap_future(opening)
        except asyncio.CancelledError:
            # Cancelled while the request was being sent: once its iterator is there, it is read to
            # its final response like any stream left early (a cancel before the send sends nothing).
            opening.add_done_callback(self._read_opened_to_final)
            raise
        reading: Future[Any] | None = None
        finished = False
        try:
            while True:
                reading = self._pool.submit(self._next, iterator)
                response = await asyncio.wrap_future(reading)
                if response is None:
                    finished = True
                    return
                out = _outputs(response)
                if out:
                    yield out
        finally:
            if not finished:
                self._read_to_final_after(reading, iterator)

    def _read_to_final_after(self, reading: Future[Any] | None, iterator: Any) -> None:
        """Read a stream its caller left (a cancel, a stage error) to its final response, on the pool,
        once the read in flight (if any) has returned: one thread reads an iterator at a time.

        Why: Triton 2.51's stub keeps every BLS response iterator that has not reached its final
        response in a map, and at unload destroys them while holding that map's lock; each destructor
        queues a cleanup message whose sender thread takes the same lock, so two or more left-over
        iterators deadlock the stub and the model never unloads ("Exit timeout expired"
        after cancelled ``epd`` streams). The stage ends the stream soon: ``epd`` aborts ``decode``.
        """

        def read_to_final() -> None:
            while self._next(iterator) is not None:
                pass

        def submit(_: object = None) -> None:
            try:
                self._pool.submit(read_to_final)
            except RuntimeError:  # the pool is shut down: the model is unloading
                pass

        if reading is None or reading.done():
            submit()
        else:
            reading.add_done_callback(submit)

    def _read_opened_to_final(self, opening: Future[Iterator[Any]]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self._read_to_final_after(None, opening.result())

    async def _answers(
        self, model: str, inputs: list[pb_utils.Tensor], parameters: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """A stage's non-empty responses, sent and read to the final one in one pool call (one
        thread hop per call: ``epd`` polls ``decode`` once per token). A caller cancelled meanwhile
        leaves the thread to finish the read, so no stream is left open."""
        responses = await self._call(self._read_whole, self._request(model, inputs, parameters))
        return [out for out in map(_outputs, responses) if out]

    async def _last(
        self, model: str, inputs: list[pb_utils.Tensor], parameters: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """A stage that answers once: its one non-empty response."""
        answers = await self._answers(model, inputs, parameters)
        if not answers:
            raise EpdError(f"{model} returned no response", ErrorCode.INTERNAL)
        return answers[-1]


class BlsEncode(BlsCaller):
    """Images through the ``encode`` ensemble, embeddings by value (inside an encoder model,
    which writes them into the store); a video's pixels through ``vit_encoder``; a clip's
    features through ``audio_encoder``.

    ``encode`` takes a request's images at once (the cpu target's: ``image`` BYTES ``[n]`` ->
    ``image_embeds`` ``[1, tokens, hidden]`` + ``image_grid_thw`` ``[n, 3]``) or, with
    ``one_image`` (the gpu target's one-image DAG), one image as UINT8 ``[1, bytes]``."""

    def __init__(
        self, encode_model: str, max_threads: int = 64, *, merge_size: int = 2, one_image: bool = False
    ) -> None:
        super().__init__(max_threads)
        self.encode_model = encode_model
        self.merge_size = merge_size
        self.one_image = one_image

    @classmethod
    def from_params(cls, params: ModelParameters) -> BlsEncode:
        """The client an ``encoder_<i>`` model's config describes."""
        return cls(
            params.string(contract.ENCODE_MODEL_KEY),
            merge_size=params.integer(contract.SPATIAL_MERGE_SIZE),
            one_image=params.boolean(contract.ENCODE_ONE_IMAGE_KEY),
        )

    @property
    def encode_many(self) -> Callable[[Sequence[bytes]], Awaitable[list[EncodedImage]]] | None:
        """Several images in one ``encode`` request; None where ``encode`` takes one image."""
        return None if self.one_image else self._encode_many

    async def __call__(self, image: bytes) -> EncodedImage:
        if not self.one_image:
            (encoded,) = await self._encode_many([image])
            return encoded
        out = await self._encode([pb_utils.Tensor(contract.IMAGE, np.frombuffer(image, dtype=np.uint8)[None].copy())])
        embeds = out[contract.IMAGE_EMBEDS]
        grid = out[contract.IMAGE_GRID_THW].reshape(-1)
        return EncodedImage(embeds.reshape(-1, embeds.shape[-1]), (int(grid[0]), int(grid[1]), int(grid[2])))

    async def _encode_many(self, images: Sequence[bytes]) -> list[EncodedImage]:
        """``images`` in one ``encode`` request (``image`` BYTES ``[n]``); the concatenated
        embeddings split per image by its grid."""
        out = await self._encode([bytes_tensor(contract.IMAGE, list(images))])
        return split_encoded(out[contract.IMAGE_EMBEDS], out[contract.IMAGE_GRID_THW], self.merge_size, len(images))

    async def _encode(self, inputs: list[pb_utils.Tensor]) -> dict[str, Any]:
        request = pb_utils.InferenceRequest(
            model_name=self.encode_model,
            inputs=inputs,
            requested_output_names=[contract.IMAGE_EMBEDS, contract.IMAGE_GRID_THW],
        )
        return _outputs(await self._call(request.exec))

    async def encode_pixels(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
        """Preprocessed pixels (a video's: ``[t*h*w, patch_dim]``, grid ``[1, 3]``) through
        ``vit_encoder`` (the cpu target's), embeddings ``[1, tokens, hidden]`` by value."""
        request = pb_utils.InferenceRequest(
            model_name=contract.VIT_ENCODER_MODEL,
            inputs=[
                pb_utils.Tensor(contract.PIXEL_VALUES, np.ascontiguousarray(pixel_values, dtype=np.float32)),
                pb_utils.Tensor(contract.IMAGE_GRID_THW, np.ascontiguousarray(grid_thw, dtype=np.int64).reshape(-1, 3)),
            ],
            requested_output_names=[contract.IMAGE_EMBEDS],
        )
        out = _outputs(await self._call(request.exec))
        return np.asarray(out[contract.IMAGE_EMBEDS])

    async def encode_audio_features(self, features: np.ndarray, lengths: np.ndarray) -> tuple[Any, Any]:
        """A clip's features (``[1, mel bins, frames]``, lengths ``[1]``) through ``audio_encoder``:
        embeddings ``[1, padded tokens, hidden]`` and the clip's tokens ``[1]``, by value: numpy from
        the cpu target's ONNX Runtime model, torch CUDA tensors (no copy) from the gpu target's
        TensorRT plan, which the encoder stores with one device copy (``_array_of``)."""
        request = pb_utils.InferenceRequest(
            model_name=contract.AUDIO_ENCODER_MODEL,
            inputs=[
                pb_utils.Tensor(contract.INPUT_FEATURES, np.ascontiguousarray(features, dtype=np.float32)),
                pb_utils.Tensor(contract.FEATURE_LENGTHS, np.ascontiguousarray(lengths, dtype=np.int64)),
            ],
            requested_output_names=[contract.AUDIO_EMBEDS, contract.AUDIO_TOKENS],
        )
        out = _outputs(await self._call(request.exec))
        return out[contract.AUDIO_EMBEDS], out[contract.AUDIO_TOKENS]


# The request being served (its asyncio task) reads decode as one stream: the old pattern, kept
# only to measure what the polls cost (request parameter ``decode_reads``, contract.DECODE_READS).
# A context variable, so that the measurement switch does not run through every path's signature.
_STREAMED_DECODE: contextvars.ContextVar[bool] = contextvars.ContextVar("streamed_decode", default=False)
# The request's audio clips, sent on to prefill as well (request parameter ``forward_media`` = raw:
# the baseline of the article's experiment, measurement only). Empty: references only.
_FORWARDED_AUDIO: contextvars.ContextVar[tuple[bytes, ...]] = contextvars.ContextVar("forwarded_audio", default=())


class BlsStages(BlsCaller):
    """:class:`python_backends.epd.pipeline.StageClient` over BLS (inside ``epd`` only)."""

    @staticmethod
    def stream_decode_in_this_request() -> None:
        """Read ``decode`` as a stream for the rest of the calling task (measurement only)."""
        _STREAMED_DECODE.set(True)

    @staticmethod
    def forward_audio_in_this_request(clips: Sequence[bytes]) -> None:
        """Send ``clips`` to prefill with the references, for the rest of the calling task
        (measurement only: prefill decodes and re-extracts them)."""
        _FORWARDED_AUDIO.set(tuple(clips))

    def __init__(self, prefill_model: str, decode_model: str, max_threads: int = 256) -> None:
        super().__init__(max_threads)
        self.prefill_model = prefill_model
        self.decode_model = decode_model

    async def encode_reference(
        self, encoder: str, image: bytes, lease_owner: int, tenant: str | None = None, modality: str = contract.IMAGE
    ) -> tuple[bytes, bool]:
        # Modalities are named as the encoders' inputs: image, video, audio.
        inputs = [bytes_tensor(modality, [image]), tensor(contract.LEASE_OWNER, [lease_owner], np.int64)]
        # Re-signed: with a tenant secret the encoder model checks the token as epd did.
        out = await self._last(encoder, inputs, None if tenant is None else {contract.TENANT: tenant_parameter(tenant)})
        return bytes(out[contract.REFERENCES].reshape(-1)[0]), bool(out[contract.CACHE_HIT].reshape(-1)[0])

    async def prefill(self, prompt: str, references: Sequence[bytes], sampling: Mapping[str, Any]) -> GenerationChunk:
        inputs = [
            bytes_tensor(contract.TEXT_INPUT, [prompt]),
            bytes_tensor(contract.SAMPLING_PARAMETERS, [json.dumps(dict(sampling))]),
        ]
        if references:
            inputs.append(bytes_tensor(contract.REFERENCES, list(references)))
        if clips := _FORWARDED_AUDIO.get():
            inputs.append(bytes_tensor(contract.AUDIO, list(clips)))
        return chunk_from_outputs(await self._last(self.prefill_model, inputs))

    async def decode(
        self,
        request_id: str,
        references: Sequence[bytes],
        transfer_params: str,
        sampling: Mapping[str, Any],
        stream: bool,
    ) -> AsyncIterator[GenerationChunk]:
        """Tokens 2..N, by polls: each call to ``decode`` gets exactly one response (FINAL in the
        same send), so no thread of this stub ever reads a stream (``pd/polling.py`` says why).
        The chunks are deltas whatever ``stream`` says: the path joins them for a non-streaming
        client."""
        request = bytes_tensor(contract.REQUEST_ID, [request_id])
        inputs = [
            request,
            bytes_tensor(contract.TRANSFER_PARAMS, [transfer_params]),
            bytes_tensor(contract.SAMPLING_PARAMETERS, [json.dumps(dict(sampling))]),
        ]
        if references:
            inputs.append(bytes_tensor(contract.REFERENCES, list(references)))
        if _STREAMED_DECODE.get():  # the old read: one stream of deltas (it can deadlock the stub)
            async for out in self._stream(self.decode_model, [*inputs, tensor(contract.STREAM, [True], bool)]):
                yield chunk_from_outputs(out)
            return
        inputs.append(tensor(contract.POLL_OFFSET, [0], np.int64))
        while True:
            out = await self._last(self.decode_model, inputs)
            chunk = chunk_from_outputs(out)
            if chunk.finished or chunk.token_ids or chunk.text:
                yield chunk
            if chunk.finished:
                return
            offset = int_of(out.get(contract.POLL_OFFSET))
            inputs = [request, tensor(contract.POLL_OFFSET, [offset], np.int64)]

    async def abort_decode(self, request_id: str) -> None:
        await self._control([bytes_tensor(contract.REQUEST_ID, [request_id])])

    async def discard_transfer(self, transfer_params: str) -> None:
        await self._control([bytes_tensor(contract.TRANSFER_PARAMS, [transfer_params])])

    async def _control(self, inputs: list[pb_utils.Tensor]) -> None:
        """A ``decode`` control request (``abort`` = true), answered by one empty final."""
        await self._answers(self.decode_model, [*inputs, tensor(contract.ABORT, [True], bool)])
