"""A client process that streams one request and then waits to be killed (a client that goes away
without closing its stream: its connection drops). Used by test_cancel_points.py.

    python -m tests.server.cancel_client URL MODEL SAMPLING_JSON PROMPT [IMAGE_FILE ...]

Prints ``sent`` once the request is on the wire and ``response`` per response it receives
(flushed), then sleeps until killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from client.epd_client import build_inputs


def main(argv: list[str]) -> None:
    url, model, sampling, prompt, *image_files = argv
    images = [Path(f).read_bytes() for f in image_files]
    client = grpcclient.InferenceServerClient(url)

    def on_response(result: object, error: object) -> None:
        print("error" if error is not None else "response", flush=True)

    client.start_stream(callback=on_response)
    client.async_stream_infer(
        model, build_inputs(grpcclient, prompt, images, True, json.loads(sampling), None),
        enable_empty_final_response=True,
    )
    print("sent", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1:])
