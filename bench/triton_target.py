"""One streaming request over ``tritonclient.grpc.aio`` -> a ``RequestRecord``.

One gRPC stream per request on one shared channel (HTTP/2 streams are cheap), so
concurrent requests never wait on each other in the client. Inputs are built before a
load point starts (``prepare``) so the timed path only sends and receives.

Optional outputs read when the model sends them (``epd`` will):

* ``timing_<stage>_ms`` (any numeric type, one value): time the pipeline spent in
  ``<stage>`` for this request, e.g. ``timing_encode_ms``; the last value seen wins.
* ``cache_hits`` (integer, one value): media items served from the embedding store.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from bench.metrics import RequestRecord
from bench.workload import BenchRequest
from client.epd_client import ONE_IMAGE_MODELS, build_inputs, takes_one_uint8_image
from client.grpc_streams import GRACE_S, InBandAbort, StreamEnds

TIMING_PREFIX, TIMING_SUFFIX = "timing_", "_ms"
CACHE_HITS_OUTPUT = "cache_hits"
SERVING_PATH_OUTPUT = "serving_path"  # epd: the path that served the request


@dataclass(frozen=True)
class PreparedRequest:
    request: BenchRequest
    inputs: list[Any]
    parameters: dict[str, Any] | None = None  # Triton request parameters (epd's ``path``)


class TritonGrpcTarget:
    """Sends requests to one Triton server; safe to share between tasks of one event loop."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient  # keep `--help` fast
        import tritonclient.grpc.aio as grpcaio

        from builders.access import AdminKeyHeader, local_admin_key

        self.url = url
        self._grpc = grpcclient
        self.client = grpcaio.InferenceServerClient(url)
        admin_key = local_admin_key()
        if admin_key is not None:  # a triton-epd-serve keeps model configs behind it (builders/access.py)
            self.client.register_plugin(AdminKeyHeader(admin_key))
        # Each stream ends by client/grpc_streams.py's rule: read to the server's close; a request
        # past its timeout is aborted in-band where the model takes it, drained in the background
        # and cancelled only if still open after the grace (never at once: Triton 2.51's leak).
        self.stream_ends = StreamEnds()
        self.aborts = InBandAbort(self.client, grpcclient)
        self._one_image_uint8: dict[str, bool] = {}  # model -> its image is one UINT8 file

    async def close(self) -> None:
        await self.stream_ends.wait(GRACE_S + 1.0)
        await self.client.close()

    async def not_ready_reason(self, model: str) -> str | None:
        """None when ``model`` is ready; otherwise why it cannot be benchmarked."""
        try:
            if not await self.client.is_server_live():
                return f"server at {self.url} is not live"
            if await self.client.is_model_ready(model):
                await self.aborts.supported(model)  # learnt here, off the timed path
                if model in ONE_IMAGE_MODELS:  # the gpu target's ensemble takes one UINT8 image
                    metadata = await self.client.get_model_metadata(model, as_json=True)
                    self._one_image_uint8[model] = takes_one_uint8_image(metadata)
                return None
        except Exception as exc:  # any transport failure is a reason to skip
            return f"cannot reach {self.url}: {exc}"
        return f"model '{model}' is not loaded on {self.url}"

    def prepare(self, request: BenchRequest, model: str, parameters: dict[str, Any] | None = None) -> PreparedRequest:
        # The same tensors the client library sends (the gpu target's ensemble takes its one image
        # as UINT8, learnt by not_ready_reason; every other model, BYTES).
        inputs = build_inputs(
            self._grpc,
            request.prompt,
            request.images,
            True,
            request.sampling,
            True,
            one_image_uint8=self._one_image_uint8.get(model, False),
        )
        return PreparedRequest(request, inputs, parameters)

    async def send(self, model: str, prepared: PreparedRequest, timeout_s: float) -> RequestRecord:
        """One request; transport and model errors end up in ``record.error``, never raised."""
        return await RequestRecord.of_request(
            prepared.request, lambda record, started: self._stream(model, prepared, record, started), timeout_s
        )

    async def _stream(self, model: str, prepared: PreparedRequest, record: RequestRecord, started: float) -> None:
        inputs, abort, key = prepared.inputs, None, prepared.request.key
        if await self.aborts.supported(model):
            inputs = [*inputs, self.aborts.request_id_input(key)]
            abort = self.aborts.for_request(model, key, self.stream_ends)

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            request: dict[str, Any] = {"model_name": model, "inputs": inputs, "request_id": key}
            if prepared.parameters:
                request["parameters"] = prepared.parameters
            yield request

        responses = self.client.stream_infer(one_request())
        finished = False  # its last response came: the server closes the stream (client/grpc_streams.py)
        try:
            async for result, error in responses:
                arrived = time.perf_counter() - started
                if error is not None:
                    record.error = str(error.message() if hasattr(error, "message") else error)
                    finished = True
                    return
                response = result.get_response()
                if read_response(result, response, record):
                    record.chunk_times.append(arrived)
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return
        finally:
            await self.stream_ends.close_stream(responses, finished, abort)


def read_response(result: Any, response: Any, record: RequestRecord) -> bool:
    """Fold one streamed response into ``record``; True when it carried output."""
    names = {output.name for output in response.outputs}
    if not names:
        return False
    if "output_token_ids" in names:
        ids = result.as_numpy("output_token_ids").reshape(-1)
        record.chunk_tokens.append(int(ids.size))
        record.output_token_ids.extend(int(t) for t in ids)
    if "num_input_tokens" in names:
        record.num_input_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
    if "num_output_tokens" in names:
        record.num_output_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
    if "finish_reason" in names:
        reason = result.as_numpy("finish_reason").reshape(-1)[0]
        record.finish_reason = (reason.decode() if isinstance(reason, bytes) else str(reason)) or record.finish_reason
    if CACHE_HITS_OUTPUT in names:
        record.cache_hits = int(result.as_numpy(CACHE_HITS_OUTPUT).reshape(-1)[0])
    if SERVING_PATH_OUTPUT in names:
        path = result.as_numpy(SERVING_PATH_OUTPUT).reshape(-1)[0]
        record.serving_path = path.decode() if isinstance(path, bytes) else str(path)
    for name in names:
        if name.startswith(TIMING_PREFIX) and name.endswith(TIMING_SUFFIX):
            stage = name[len(TIMING_PREFIX) : -len(TIMING_SUFFIX)]
            record.stage_ms[stage] = float(result.as_numpy(name).reshape(-1)[0])
    return True
