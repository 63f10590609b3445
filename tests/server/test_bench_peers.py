"""The vllm-colocated peer for real: ``vllm serve`` started and stopped by the harness with our
engine settings, driven by the OpenAI SSE target; its chat template renders our exact prompt
and its greedy tokens equal our ``llm``'s for the same request."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bench.peer_servers import PeerSettings, vllm_colocated
from bench.triton_target import TritonGrpcTarget
from bench.workload import LengthDist, WorkloadBuilder, WorkloadSpec
from builders.tritonserver import REPO_ROOT, TritonServer

pytestmark = pytest.mark.server


def test_vllm_colocated_peer_matches_our_llm(server: TritonServer, model_dir: Path, tmp_path: Path) -> None:
    spec = WorkloadSpec(seed=3, output_tokens=LengthDist.parse("8", minimum=1), image_sizes=((320, 240),),
                        tokenizer=model_dir / "tokenizer.json")
    requests = WorkloadBuilder(spec).build(2, 0.0, "equality", 0)
    settings = PeerSettings.from_target(model_dir, REPO_ROOT / "build" / "test-logs", tmp_path / "ec")

    async def ours() -> list:
        target = TritonGrpcTarget(server.grpc_url)
        try:
            return [await target.send("llm", target.prepare(r, "llm"), 120.0) for r in requests]
        finally:
            await target.close()

    expected = asyncio.run(ours())
    with vllm_colocated(settings) as handle:
        pid = handle.pids[0]

        async def peer() -> tuple[list, dict[str, str]]:
            target = handle.make_target(True)
            try:
                model = "vllm-colocated"
                sent = [await target.send(model, target.prepare(r, model), 120.0) for r in requests]
                return sent, target.rendered_prompts
            finally:
                await target.close()

        records, rendered = asyncio.run(peer())
    for request, mine, theirs in zip(requests, expected, records, strict=True):
        assert theirs.ok, theirs.error
        assert rendered[request.key] == request.prompt  # vLLM's chat template gives our prompt, exactly
        assert theirs.num_input_tokens == mine.num_input_tokens
        assert len(theirs.output_token_ids) == 8 and theirs.output_token_ids == mine.output_token_ids
        assert 0 < theirs.chunk_times[0] <= theirs.chunk_times[-1]
    with pytest.raises(ProcessLookupError):  # stopped with its group
        os.kill(pid, 0)
