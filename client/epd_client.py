"""Talk to triton-epd's user-facing models (``llm``, ``ensemble``, ``epd``) over gRPC or HTTP.

The interface mirrors Triton's vllm_backend: ``text_input``, ``image`` (encoded
images, one per element; ``video`` and ``audio`` likewise for ``llm``), ``stream``,
``sampling_parameters`` (JSON) and ``exclude_input_in_output``. gRPC streams tokens as they are generated; HTTP returns
the whole answer in one response.
"""

from __future__ import annotations

import base64
import json
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import requests

from client.grpc_streams import GRACE_S, end_sync_stream

DEFAULT_MODEL = "llm"
SYSTEM_PROMPT = "You are a helpful assistant."


class ClientError(RuntimeError):
    """A failure the user can act on (server down, model missing, request rejected)."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


def chat_prompt(text: str, num_images: int, num_audios: int = 0) -> str:
    """The chat format for one user turn with ``num_audios`` audio clips (Qwen2-Audio's lines, as
    its chat template writes them) and ``num_images`` images (Qwen2-VL's placeholders) first."""
    audio = "".join(f"Audio {i}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" for i in range(1, num_audios + 1))
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{audio}{vision}{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def _as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass
class GenerateResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""
    # Arrival time (time.perf_counter) of each response, for TTFT/ITL measurements.
    chunk_times: list[float] = field(default_factory=list)
    started_at: float = 0.0
    # ``epd``'s optional outputs, sent with its last response: images served from the
    # embedding cache, and the pipeline's time per stage.
    cache_hits: int | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.started_at

    @property
    def e2e_s(self) -> float:
        return self.chunk_times[-1] - self.started_at

    def summary(self) -> dict[str, Any]:
        """What the benchmarks record per request."""
        return {
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "cache_hits": self.cache_hits,
            "timings_ms": dict(self.timings_ms),
            "token_ids": self.token_ids,
        }

    def add(self, outputs: dict[str, np.ndarray]) -> None:
        self.chunk_times.append(time.perf_counter())
        if "text_output" in outputs:
            self.text += "".join(_as_text(x) for x in outputs["text_output"].reshape(-1))
        if "output_token_ids" in outputs:
            self.token_ids.extend(int(t) for t in outputs["output_token_ids"].reshape(-1))
        if "num_input_tokens" in outputs:
            self.num_input_tokens = int(outputs["num_input_tokens"].reshape(-1)[0])
        if "num_output_tokens" in outputs:
            self.num_output_tokens = int(outputs["num_output_tokens"].reshape(-1)[0])
        if "finish_reason" in outputs:
            reason = _as_text(outputs["finish_reason"].reshape(-1)[0])
            self.finish_reason = reason or self.finish_reason
        if "cache_hits" in outputs:
            self.cache_hits = int(outputs["cache_hits"].reshape(-1)[0])
        for name, value in outputs.items():
            if name.startswith("timing_") and name.endswith("_ms"):
                self.timings_ms[name[len("timing_") : -len("_ms")]] = float(value.reshape(-1)[0])


# Models that may take their ``image`` as the one encoded file, UINT8 [1, bytes]: the gpu target's
# ``ensemble`` (its encode runs the TensorRT plan, one image per request, in a static DAG). The
# cpu target's ``ensemble`` takes 0 or more encoded images as BYTES, like ``llm`` and ``epd``: the
# clients ask these models' metadata once (:func:`takes_one_uint8_image`).
ONE_IMAGE_MODELS = frozenset({"ensemble"})


def takes_one_uint8_image(metadata: Mapping[str, Any]) -> bool:
    """Whether a model's metadata (``get_model_metadata(..., as_json=True)``) declares ``image``
    as UINT8: exactly one encoded file per request, ``[1, bytes]``."""
    return any(i.get("name") == "image" and i.get("datatype") == "UINT8" for i in metadata.get("inputs", []))


def check_images_for(model: str, images: Sequence[bytes], one_image_uint8: bool) -> None:
    if one_image_uint8 and len(images) != 1:
        raise ClientError(
            f"model '{model}' takes exactly one image per request (a static ensemble cannot loop "
            f"over images), got {len(images)}; use 'llm' or 'epd' for 0 or several images"
        )


def build_inputs(
    module: Any,
    prompt: str,
    images: Sequence[bytes],
    stream: bool,
    sampling: dict[str, Any] | None,
    exclude_input_in_output: bool | None,
    one_image_uint8: bool = False,
    videos: Sequence[bytes] = (),
    audios: Sequence[bytes] = (),
) -> list[Any]:
    def tensor(name: str, array: np.ndarray, dtype: str) -> Any:
        item = module.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        return item

    inputs = [tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    if images and one_image_uint8:
        inputs.append(tensor("image", np.frombuffer(images[0], dtype=np.uint8).reshape(1, -1), "UINT8"))
    elif images:
        inputs.append(tensor("image", np.array(list(images), dtype=np.object_), "BYTES"))
    if videos:  # encoded video files (llm)
        inputs.append(tensor("video", np.array(list(videos), dtype=np.object_), "BYTES"))
    if audios:  # encoded audio files (llm of an audio checkpoint)
        inputs.append(tensor("audio", np.array(list(audios), dtype=np.object_), "BYTES"))
    inputs.append(tensor("stream", np.array([stream]), "BOOL"))
    if sampling:
        payload = json.dumps(sampling).encode("utf-8")
        inputs.append(tensor("sampling_parameters", np.array([payload], dtype=np.object_), "BYTES"))
    if exclude_input_in_output is not None:
        inputs.append(tensor("exclude_input_in_output", np.array([exclude_input_in_output]), "BOOL"))
    return inputs


def _server_down(url: str, protocol: str, exc: Exception) -> ClientError:
    return ClientError(
        f"cannot reach Triton at {url} ({protocol}): {exc}. Is the server running? "
        "Start it with `make serve` (or `triton-epd-serve`)."
    )


class GrpcClient:
    """Streaming gRPC client: ``generate`` calls ``on_text`` with each new piece of text. Each
    request has its own stream, ended by the rule of ``client/grpc_streams.py`` (read to the
    server's close; a request given up on is cancelled only after a grace)."""

    def __init__(self, url: str = "localhost:8001", model: str = DEFAULT_MODEL, grace_s: float = GRACE_S) -> None:
        import tritonclient.grpc as grpcclient

        self._module = grpcclient
        self.url = url
        self.model = model
        self.grace_s = grace_s  # a request given up on: its stream is read on this long, then cancelled
        self._client = grpcclient.InferenceServerClient(url)
        self._one_image_uint8: bool | None = None  # learnt from the model's metadata, once

    def one_image_uint8(self) -> bool:
        """Whether the model takes one image as UINT8 (the gpu target's ``ensemble``); asked of
        the server once, for :data:`ONE_IMAGE_MODELS` only. An unreachable or unknown model reads
        as BYTES: the request itself then says what is wrong."""
        if self._one_image_uint8 is None:
            self._one_image_uint8 = False
            if self.model in ONE_IMAGE_MODELS:
                try:
                    self._one_image_uint8 = takes_one_uint8_image(
                        self._client.get_model_metadata(self.model, as_json=True)
                    )
                except Exception:
                    self._one_image_uint8 = None  # asked again next time
                    return False
        return self._one_image_uint8

    def _start_stream(self) -> queue.Queue[tuple[Any, Any]]:
        """Open the client's (one) gRPC stream; its responses and errors land in the queue."""
        responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        try:
            self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        except Exception as exc:
            raise _server_down(self.url, "gRPC", exc) from None
        return responses

    def check_ready(self) -> None:
        try:
            ready = self._client.is_model_ready(self.model)
        except Exception as exc:
            raise _server_down(self.url, "gRPC", exc) from None
        if not ready:
            raise ClientError(f"model '{self.model}' is not ready on {self.url}")

    def generate(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        sampling: dict[str, Any] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel_after_chunks: int | None = None,
        timeout_s: float = 600.0,
        parameters: dict[str, Any] | None = None,
        videos: Sequence[bytes] = (),
        audios: Sequence[bytes] = (),
    ) -> GenerateResult:
        """One streaming request; raises ClientError with Triton's status on failure.

        ``cancel_after_chunks`` gives the request up after that many responses (used to test
        that cancellation frees everything on the server): the stream is read on for
        ``grace_s`` and cancelled if still open then (client/grpc_streams.py). ``parameters``: Triton
        request parameters (``epd``: ``{"encoder": "encoder_1"}`` pins its encodes). An
        image item ``b"mm_hash:<hex>"`` names an image pre-encoded with :meth:`warm_up`.
        """
        one_image_uint8 = self.one_image_uint8()
        check_images_for(self.model, images, one_image_uint8)
        result = GenerateResult(started_at=time.perf_counter())
        responses = self._start_stream()
        finished = False  # its final (or an error) response came: the server closes the stream
        try:
            self._client.async_stream_infer(
                self.model,
                build_inputs(
                    self._module, prompt, images, True, sampling, None, one_image_uint8, videos, audios
                ),
                enable_empty_final_response=True,  # every output the model sends
                parameters=parameters,
            )
            while True:
                try:
                    response, error = responses.get(timeout=timeout_s)
                except queue.Empty:
                    raise ClientError(f"no response from '{self.model}' in {timeout_s:.0f} s") from None
                if error is not None:
                    finished = True
                    raise ClientError(error.message(), error.status())
                outputs = {o.name: response.as_numpy(o.name) for o in response.get_response().outputs}
                if outputs:
                    before = len(result.text)
                    result.add(outputs)
                    if on_text is not None:
                        on_text(result.text[before:])
                final = response.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return result
                if cancel_after_chunks is not None and len(result.chunk_times) >= cancel_after_chunks:
                    return result  # given up: drained for the grace, then cancelled (client/grpc_streams.py)
        finally:
            end_sync_stream(self._client, finished, self.grace_s)

    def warm_up(
        self, images: Sequence[bytes], encoder: str = "encoder_0", timeout_s: float = 600.0, tenant: str | None = None
    ) -> list[str]:
        """Pre-encode ``images`` into the server's embedding cache through an encoder model;
        returns each image's ``mm_hash``, to send later as ``b"mm_hash:" + hash`` instead of
        the bytes (``epd`` answers NOT_FOUND once an entry is evicted: send the bytes then).
        ``tenant``: pre-encode for that tenant; its requests must name the same tenant (a server
        with a tenant secret takes the signed token: ``triton-epd-client sign-tenant``)."""
        image = self._module.InferInput("image", [len(images)], "BYTES")
        image.set_data_from_numpy(np.array(list(images), dtype=np.object_))
        responses = self._start_stream()
        finished = False
        try:
            parameters = None if tenant is None else {"tenant": tenant}
            self._client.async_stream_infer(encoder, [image], parameters=parameters)
            try:
                response, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise ClientError(f"no response from '{encoder}' in {timeout_s:.0f} s") from None
            finished = True  # the encoder answers with one response
            if error is not None:
                raise ClientError(error.message(), error.status())
            return [_as_text(h) for h in response.as_numpy("mm_hash").reshape(-1)]
        finally:
            end_sync_stream(self._client, finished, self.grace_s)

    def close(self) -> None:
        self._client.close()


class HttpClient:
    """HTTP client on Triton's generate extension (``/v2/models/<model>/generate``).

    Triton's plain HTTP ``infer`` refuses decoupled models, so HTTP goes through the
    generate endpoint: JSON in, JSON out, images as base64 strings.
    """

    def __init__(self, url: str = "localhost:8000", model: str = DEFAULT_MODEL, timeout_s: float = 600.0) -> None:
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def _base(self) -> str:
        return f"http://{self.url}/v2/models/{self.model}"

    def check_ready(self) -> None:
        try:
            response = self._session.get(f"{self._base()}/ready", timeout=10)
        except requests.RequestException as exc:
            raise _server_down(self.url, "HTTP", exc) from None
        if response.status_code != 200:
            raise ClientError(f"model '{self.model}' is not ready on {self.url}")

    def generate(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        sampling: dict[str, Any] | None = None,
        exclude_input_in_output: bool = True,
        videos: Sequence[bytes] = (),
        audios: Sequence[bytes] = (),
    ) -> GenerateResult:
        body: dict[str, Any] = {
            "text_input": prompt,
            "stream": False,
            "exclude_input_in_output": exclude_input_in_output,
        }
        if images:
            body["image"] = [base64.b64encode(image).decode("ascii") for image in images]
        if videos:  # base64 in JSON, like images (llm)
            body["video"] = [base64.b64encode(video).decode("ascii") for video in videos]
        if audios:  # base64 in JSON, like videos (llm of an audio checkpoint)
            body["audio"] = [base64.b64encode(audio).decode("ascii") for audio in audios]
        if sampling:
            body["sampling_parameters"] = json.dumps(sampling)
        result = GenerateResult(started_at=time.perf_counter())
        try:
            # Connection: close -- Triton 2.51 keeps counting a keep-alive connection that got an error
            # answer from /generate, even after the client closes it, and then waits its whole exit timeout.
            response = self._session.post(
                f"{self._base()}/generate", json=body, timeout=self.timeout_s, headers={"Connection": "close"}
            )
        except requests.RequestException as exc:
            raise _server_down(self.url, "HTTP", exc) from None
        payload = response.json()
        if response.status_code != 200:
            raise ClientError(payload.get("error", response.text), str(response.status_code))
        result.add(
            {
                name: np.array(value if isinstance(value, list) else [value], dtype=_HTTP_DTYPES[name])
                for name, value in payload.items()
                if name in _HTTP_DTYPES
            }
        )
        return result

    def close(self) -> None:
        self._session.close()


# The generate endpoint returns JSON values; give them the dtypes gRPC returns.
_HTTP_DTYPES = {
    "text_output": np.object_,
    "output_token_ids": np.int64,
    "num_input_tokens": np.uint32,
    "num_output_tokens": np.uint32,
    "finish_reason": np.object_,
}
