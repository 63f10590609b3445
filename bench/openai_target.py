"""One streaming request to an OpenAI-compatible server (``vllm serve``, our EPD router)
-> a ``RequestRecord``, measured by the same metric code as the Triton target.

The request is the workload's own: ``BenchRequest.prompt`` is the Qwen2-VL chat prompt
our Triton modes get (``client.epd_client.chat_prompt``); here it is turned back into
chat messages (system + one user turn: the images as ``data:`` URIs, then the text), and
the server's chat template must render them to exactly that prompt. The equality pass
checks it (``return_prompt_text``) instead of assuming it.

Streaming is SSE (``stream: true``). A chunk counts as output when it carries tokens
(``token_ids``, asked for with ``return_token_ids``; vLLM's first chunk carries only the
assistant role and no token, and is not a first token). The usage chunk
(``stream_options.include_usage``) gives the prompt and completion token counts.

Our router (``bench.epd_router``) reports the time its encoder fan-out took in the
``x-epd-encode-ms`` response header; it becomes ``stage_ms["encode"]`` (see ``split_stages``).
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from bench.metrics import RequestRecord
from bench.workload import BenchRequest

ENCODE_MS_HEADER = "x-epd-encode-ms"
ENCODE_ITEMS_HEADER = "x-epd-encode-items"
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_CHAT_PROMPT = re.compile(
    r"\A<\|im_start\|>system\n(?P<system>.*?)<\|im_end\|>\n"
    r"<\|im_start\|>user\n(?P<user>.*)<\|im_end\|>\n<\|im_start\|>assistant\n\Z",
    re.DOTALL,
)
IMAGE_MIME = {
    b"\xff\xd8": "image/jpeg",
    b"\x89P": "image/png",
    b"RI": "image/webp",
    b"BM": "image/bmp",
    b"GI": "image/gif",
}


class PromptFormatError(ValueError):
    """A workload prompt that is not one Qwen2-VL user turn (cannot be sent as chat messages)."""


@dataclass(frozen=True)
class ChatParts:
    system: str
    text: str
    num_images: int


def parse_chat_prompt(prompt: str) -> ChatParts:
    """Invert ``chat_prompt``: the system text, the user text and the number of leading images."""
    match = _CHAT_PROMPT.match(prompt)
    if match is None:
        raise PromptFormatError("prompt is not a Qwen2-VL chat prompt made by client.epd_client.chat_prompt")
    user = match["user"]
    count = 0
    while user.startswith(VISION_PLACEHOLDER):
        user = user[len(VISION_PLACEHOLDER) :]
        count += 1
    if VISION_PLACEHOLDER in user or "<|image_pad|>" in user:
        raise PromptFormatError("images must all come before the text (as chat_prompt puts them)")
    return ChatParts(match["system"], user, count)


def image_data_uri(data: bytes) -> str:
    mime = IMAGE_MIME.get(data[:2], "application/octet-stream")
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def chat_body(request: BenchRequest, served_model: str, want_prompt_text: bool = False) -> dict[str, Any]:
    """The chat-completions body for ``request``: the same prompt, images and sampling."""
    parts = parse_chat_prompt(request.prompt)
    if parts.num_images != len(request.images):
        raise PromptFormatError(f"prompt has {parts.num_images} image placeholders for {len(request.images)} images")
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_uri(i)}} for i in request.images
    ]
    content.append({"type": "text", "text": parts.text})
    body: dict[str, Any] = {
        "model": served_model,
        "messages": [{"role": "system", "content": parts.system}, {"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **request.sampling,  # max_tokens, temperature, ignore_eos: vLLM takes them as they are
    }
    if want_prompt_text:
        body["return_prompt_text"] = True
    return body


class SseParser:
    """Server-sent events -> ``data:`` payloads; lines may be split across network chunks."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        out = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line.startswith(b"data:"):
                out.append(line[5:].strip().decode("utf-8"))
        return out


def fold_chunk(payload: dict[str, Any], record: RequestRecord) -> bool:
    """Fold one streamed chat chunk into ``record``; True when it carried output tokens."""
    if "error" in payload and not payload.get("choices"):
        error = payload["error"]
        record.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return False
    if payload.get("prompt_token_ids"):
        record.num_input_tokens = len(payload["prompt_token_ids"])
    usage = payload.get("usage") or {}
    if usage.get("prompt_tokens"):
        record.num_input_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        record.num_output_tokens = int(usage["completion_tokens"])
    carried = False
    for choice in payload.get("choices") or []:
        ids = choice.get("token_ids") or []
        if ids:
            record.output_token_ids.extend(int(t) for t in ids)
            record.chunk_tokens.append(len(ids))
            carried = True
        elif (choice.get("delta") or {}).get("content"):
            carried = True  # a server that sends no token ids: one token per content chunk
        if choice.get("finish_reason"):
            record.finish_reason = str(choice["finish_reason"])
    return carried


def split_stages(record: RequestRecord) -> None:
    """With the router's encode time: encode, then prefill = TTFT - encode (the consumer's
    part of the first token: its own preprocessing, the EC load, prefill and the hops),
    decode = e2e - TTFT. Without it (one colocated engine) the record keeps no stages and
    the report splits first token vs decode from the client's times."""
    encode = record.stage_ms.get("encode")
    if encode is None or not record.ok:
        return
    ttft_ms, e2e_ms = record.chunk_times[0] * 1000.0, record.chunk_times[-1] * 1000.0
    record.stage_ms["prefill"] = max(ttft_ms - encode, 0.0)
    record.stage_ms["decode"] = e2e_ms - ttft_ms


@dataclass(frozen=True)
class PreparedChat:
    request: BenchRequest
    body: bytes  # serialized before the load point starts: the timed path only sends


class PeerServerInfo:
    """Answers the questions ``Sweep`` asks a Triton server (metadata, model index, model
    configs) for an OpenAI-compatible peer, so its layout (engine processes = instances)
    is reported the same way. ``configs`` are Triton-shaped: ``instance_group`` counts."""

    def __init__(self, name: str, version: str, configs: dict[str, dict[str, Any]]) -> None:
        self.name, self.version, self.configs = name, version, configs

    async def get_server_metadata(self, as_json: bool = True) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}

    async def get_model_repository_index(self, as_json: bool = True) -> dict[str, Any]:
        return {"models": [{"name": name, "state": "READY"} for name in self.configs]}

    async def get_model_config(self, name: str, as_json: bool = True) -> dict[str, Any]:
        return {"config": self.configs[name]}


class OpenAIChatTarget:
    """Sends requests for one mode model (e.g. ``vllm-epd``) to one OpenAI-compatible
    endpoint; safe to share between tasks of one event loop (the HTTP session is made on
    first use, inside the loop)."""

    def __init__(
        self, base_url: str, model: str, served_model: str, info: PeerServerInfo, want_prompt_text: bool = False
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.served_model = served_model
        self.client = info
        self.want_prompt_text = want_prompt_text
        self.rendered_prompts: dict[str, str] = {}
        self._session: Any = None

    def _http(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def not_ready_reason(self, model: str) -> str | None:
        if model != self.model:
            return f"model '{model}' is not served by the peer at {self.base_url} (it serves '{self.model}')"
        try:
            async with self._http().get(f"{self.base_url}/health") as response:
                if response.status == 200:
                    return None
                return f"{self.base_url}/health answered {response.status}"
        except Exception as exc:  # any transport failure is a reason to skip
            return f"cannot reach {self.base_url}: {exc}"

    def prepare(self, request: BenchRequest, model: str) -> PreparedChat:  # one model per target
        body = chat_body(request, self.served_model, self.want_prompt_text)
        return PreparedChat(request, json.dumps(body).encode("utf-8"))

    async def send(self, model: str, prepared: PreparedChat, timeout_s: float) -> RequestRecord:
        """One request; transport and server errors end up in ``record.error``, never raised."""
        record = await RequestRecord.of_request(
            prepared.request, lambda record, started: self._stream(prepared, record, started), timeout_s
        )
        split_stages(record)
        return record

    async def _stream(self, prepared: PreparedChat, record: RequestRecord, started: float) -> None:
        headers = {"Content-Type": "application/json", "x-request-id": prepared.request.key}
        async with self._http().post(
            f"{self.base_url}/v1/chat/completions", data=prepared.body, headers=headers
        ) as response:
            if response.status != 200:
                text = await response.text()
                record.error = f"HTTP {response.status}: {text[:300]}"
                return
            encode_ms = response.headers.get(ENCODE_MS_HEADER)
            if encode_ms is not None:
                record.stage_ms["encode"] = float(encode_ms)
            parser = SseParser()
            async for chunk in response.content.iter_any():
                arrived = time.perf_counter() - started
                for data in parser.feed(chunk):
                    if data == "[DONE]":
                        return
                    payload = json.loads(data)
                    if payload.get("prompt_text") is not None:
                        self.rendered_prompts[record.key] = payload["prompt_text"]
                    if fold_chunk(payload, record):
                        record.chunk_times.append(arrived)
                    if record.error:
                        return
