"""An OpenAI-compatible chat API in front of triton-epd: a Triton client that serves
``POST /v1/chat/completions`` and ``GET /v1/models`` and forwards each chat to the ``epd`` or
``llm`` model over gRPC streaming.

Parts: ``schemas`` (the request and response bodies), ``errors`` (OpenAI-shaped errors and
their HTTP status), ``prompt`` (the checkpoint's chat template, rendered as ``vllm serve``
renders it, and the images and videos of the messages), ``triton_backend`` (the gRPC stream to Triton),
``app`` (the FastAPI routes) and ``__main__`` (``python -m client.openai_server``).
"""
