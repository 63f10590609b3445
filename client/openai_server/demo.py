"""The OpenAI half of ``make demo``: one streamed chat completion with the official ``openai`` client.

    python -m client.openai_server.demo --base-url http://127.0.0.1:9000/v1 [--model epd]

The image goes inline as a ``data:`` URL, as an application would send it. The key it sends:
``--api-key``, else the server's own variables (``TRITON_EPD_API_KEY``'s first key, ``VLLM_API_KEY``),
else ``OPENAI_API_KEY``; none of them: a placeholder (a server without keys checks none).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any

SAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "samples" / "sample.jpg"
SAMPLE_PROMPT = "What is in this picture?"


def chat_messages(prompt: str, image: bytes) -> list[dict[str, Any]]:
    data_url = "data:image/jpeg;base64," + base64.b64encode(image).decode("ascii")
    # The image first, as client.epd_client.chat_prompt puts it: the same prompt, the same tokens.
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": prompt},
    ]}]  # fmt: skip


def default_api_key(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    first_key = env.get("TRITON_EPD_API_KEY", "").split(",")[0].strip()
    return first_key or env.get("VLLM_API_KEY") or env.get("OPENAI_API_KEY") or "unused"


def run(
    base_url: str,
    model: str = "epd",
    image: Path = SAMPLE_IMAGE,
    max_tokens: int = 24,
    expected: str | None = None,
    api_key: str | None = None,
) -> int:
    """``expected``: the text the answer must be (``make demo`` passes ``llm``'s greedy answer)."""
    from openai import OpenAI, OpenAIError

    client = OpenAI(base_url=base_url, api_key=api_key or default_api_key())
    print(f"\n>>> openai client: {base_url} model={model}: {SAMPLE_PROMPT!r} + image {image.name}")
    print(">>> answer: ", end="", flush=True)
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=chat_messages(SAMPLE_PROMPT, image.read_bytes()),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage, text = None, ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
    except OpenAIError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if usage is None:
        print("\nerror: the stream ended without usage", file=sys.stderr)
        return 1
    print(f"\n>>> usage: {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} completion tokens")
    if expected is not None:
        if text != expected:
            print(f">>> the OpenAI answer differs from llm's: {text!r} vs {expected!r}", file=sys.stderr)
            return 1
        print(">>> the same text as llm's answer")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    parser.add_argument("--model", default="epd")
    parser.add_argument("--image", type=Path, default=SAMPLE_IMAGE)
    parser.add_argument("--api-key", help="the key to send (default: see above)")
    args = parser.parse_args(argv)
    return run(args.base_url, args.model, args.image, api_key=args.api_key)


if __name__ == "__main__":
    sys.exit(main())
