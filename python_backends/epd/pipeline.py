"""The ``epd`` orchestrator: hash -> lookup -> choose a path -> serve, Triton-free.

Who calls what: the ``epd`` model (``model_repository/epd/1/model.py``) builds one
:class:`EpdPipeline` in ``initialize`` with the node's :class:`EmbeddingStore`, a
:class:`StageClient` that reaches the other models through BLS (``triton_edge/bls.py``) and,
unless its policy is ``disaggregated``, its own colocated vLLM engine; per request it iterates
:meth:`EpdPipeline.run` on its event loop and turns each :class:`GenerationChunk` into a
response. Unit tests pass scripted fakes instead (tests/unit/test_epd_pipeline.py,
tests/unit/test_epd_paths.py).

Per request:

1. **hash** and 2. **lookup** (``epd/references.py``): content keys (in the request's tenant's
   key space under the ``isolated`` tenant policy), and leased references for the images the
   store holds.
3. **choose the path**: the one the request forces (Triton request parameter ``path``), else
   the deployment's policy: ``disaggregated``, ``colocated``, or ``adaptive`` (default), which
   asks the cost model (``path_cost.py``) for the path with the lower predicted completion time.
   Except where one path dominates: in the E|PD topology (``colocated_encodes = encoders``) with
   the engines on shared processors, both paths encode with the same encoder models and run the
   language model on the same cores, and the disaggregated one only adds the prefill-to-decode
   handoff and its hops. There ``adaptive`` serves every request on the colocated path (reason
   ``dominates``), with no probes: measured slower at 12 of 12 points on three workloads, by
   2-9% (4 images, 2-16 tokens) to 24-69% (long answers, reused images), and adaptive's probes
   and kept streaks cost 3-8% (docs/benchmarks/epd-pays.md).
   A forced path this epd cannot serve is an error (UNAVAILABLE), never a silent switch. A request
   the chosen path cannot serve as asked goes to one that can, with its reason (:meth:`serving`:
   logprobs under a grammar take the colocated path), or is refused if it is bound to the split.
4. **serve** on that path: ``epd/disaggregated.py`` (encoders -> prefill -> KV transfer ->
   decode; each missed image's encoder by the rule in ``epd/references.py``) or
   ``epd/colocated.py`` (epd's own engine, store hits as embeddings).

The last chunk carries the timings, the cache counts and the path (``serving_path`` output);
its times feed the cost model. Every lease the request took is released: on finishing, before
its last chunk is handed on; on a failure or cancellation, when the request ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence

from python_backends import contract
from python_backends.engines.generation import GenerationChunk, ms_since
from python_backends.epd.colocated import ColocatedEngine, ColocatedPath
from python_backends.epd.disaggregated import DisaggregatedPath, StageClient
from python_backends.epd.path_cost import Decision, PathCostModel, RequestShape
from python_backends.epd.references import ImageReferences, LeasedReferences
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import CachedImage, GenerateRequest
from python_backends.request.images import ImageLimits, header_pixels
from python_backends.request.sampling import DEFAULT_MAX_TOKENS
from python_backends.store import EmbeddingStore, KeyConfig

__all__ = ["EpdPipeline", "StageClient"]


class EpdPipeline:
    def __init__(
        self,
        store: EmbeddingStore,
        stages: StageClient,
        keys: KeyConfig,
        encoders: Sequence[str],
        *,
        node_cache: bool = True,
        tenant_policy: str = "isolated",
        colocated: ColocatedEngine | None = None,
        image_limits: ImageLimits | None = None,
        policy: str = contract.ADAPTIVE_POLICY,
        cost_model: PathCostModel | None = None,
        colocated_encodes: str = "engine",
    ) -> None:
        self.store = store
        # Stages that route images themselves (remote encoders) say so: the pipeline then picks no
        # encoder for an image (``ImageReferences.pick``), so no pick of its own is discarded there.
        self.references = ImageReferences(
            store, keys, encoders, stages.encode_reference, node_cache=node_cache, tenant_policy=tenant_policy,
            routes_images=bool(getattr(stages, "routes_images", False)),
        )  # fmt: skip
        self.paths: dict[str, DisaggregatedPath | ColocatedPath] = {
            contract.DISAGGREGATED_PATH: DisaggregatedPath(stages, self.references)
        }
        if colocated is not None:
            limits = image_limits or ImageLimits()
            encoders_encode = colocated_encodes == "encoders"
            self.paths[contract.COLOCATED_PATH] = ColocatedPath(colocated, self.references, limits, encoders_encode)
        if policy not in contract.PATH_POLICIES:
            raise ValueError(f"path_policy must be one of {', '.join(contract.PATH_POLICIES)}, got {policy!r}")
        if policy != contract.ADAPTIVE_POLICY and policy not in self.paths:
            raise ValueError(f"path_policy {policy!r} needs the colocated engine, which this epd does not run")
        self.policy = policy
        self.cost = cost_model or PathCostModel()
        # The path that dominates the other whatever the request (step 3 of the module docstring).
        dominates = colocated is not None and colocated_encodes == "encoders" and self.cost.shared_compute
        self.dominant_path = contract.COLOCATED_PATH if dominates else None

    def encoder_for(self, key: str, pinned: str | None = None) -> str:
        """The encoder model an image goes to on the local path (``ImageReferences.encoder_for``)."""
        return self.references.encoder_for(key, pinned)

    def shape(self, request: GenerateRequest, leased: LeasedReferences) -> RequestShape:
        pixels = [
            header_pixels(image) if isinstance(image, bytes) else 0
            for image in request.images
            if not isinstance(image, CachedImage)
        ]
        patch = 14 * 14  # Qwen2-VL's patch; the grid of a stored image gives its size
        pixels += [patch * t * h * w for ref in leased.found.values() for t, h, w in [ref.grid_thw or (0, 0, 0)]]
        return RequestShape(
            images=len(request.images),
            misses=len(leased.missing),
            largest_pixels=max(pixels, default=0),
            output_tokens=int(request.sampling.get("max_tokens", DEFAULT_MAX_TOKENS)),
        )

    def decide(self, shape: RequestShape, forced: str | None) -> Decision:
        """The path of one request (the rule of the module docstring, step 3)."""
        if forced is not None:
            if forced not in self.paths:
                raise EpdError(
                    f"path {forced!r} is not available on this epd: it runs without a colocated engine "
                    f"(path_policy={self.policy}); send path={contract.DISAGGREGATED_PATH} or no path",
                    ErrorCode.UNAVAILABLE,
                )
            return Decision(forced, "forced")
        if self.policy != contract.ADAPTIVE_POLICY:
            return Decision(self.policy, "policy")
        if self.dominant_path is not None:
            return Decision(self.dominant_path, "dominates")
        return self.cost.choose(shape, self.paths)

    def serving(self, request: GenerateRequest, decision: Decision) -> Decision:
        """``decision``, or the path that serves what the request asks where ``decision``'s cannot:
        logprobs under a grammar are vLLM's (masked) only on the colocated path (the split's decode
        masks after vLLM computes logprobs: ``pd/grammar.py``)."""
        sampling = request.sampling
        if decision.path != contract.DISAGGREGATED_PATH or sampling.get("structured_outputs") is None:
            return decision
        if sampling.get("logprobs") is None:
            return decision
        if contract.COLOCATED_PATH not in self.paths or decision.reason in ("forced", "encoder pinned"):
            raise EpdError(
                "logprobs under structured_outputs are served on the colocated path only, and this request "
                f"is bound to the disaggregated one ({decision.reason}); ask for one of the two",
                ErrorCode.INVALID_ARG,
            )
        return Decision(contract.COLOCATED_PATH, "grammar logprobs")

    async def run(
        self,
        request: GenerateRequest,
        request_id: str,
        encoder: str | None = None,
        tenant: str | None = None,
        path: str | None = None,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Serve one request (``encoder``: pin its images' encodes to that encoder model, which
        takes the disaggregated path unless ``path`` says otherwise;
        ``tenant``: the checked tenant whose key space its images and ``mm_hash`` references use,
        under the ``isolated`` policy; ``path``: force that path; ``on_decision``: told the
        decision, e.g. for /metrics). The last chunk carries the timings, cache counts and the
        path. Closing the iterator early (client cancelled) stops the path and releases every
        lease."""
        timings: dict[str, float] = {}
        leased = LeasedReferences()
        try:
            if encoder is not None:
                self.references.checked_pin(encoder)  # an unknown name fails before any work
            start = time.perf_counter()
            self.references.lookup(request.images, leased, timings, tenant, request.videos, request.audios)
            shape = self.shape(request, leased)
            if path is None and encoder is not None:  # only the disaggregated path calls encoders
                decision = Decision(contract.DISAGGREGATED_PATH, "encoder pinned")
            else:
                decision = self.decide(shape, path)
            decision = self.serving(request, decision)
            timings["lookup"] += ms_since(start) - timings["lookup"] - timings["hash"]  # the decision is lookup's
            encodes = len(leased.missing)
            mark = self.cost.started(decision.path, probe=decision.reason == "probe")
            # ``on_decision`` (epd: /metrics, a stub-to-server round trip per value) is told after
            # the first token went out, not before the engine starts: it is not on the request's
            # time to first token. A last chunk is never sent before it, nor a failure unrecorded.
            pending = [on_decision] if on_decision is not None else []

            def tell() -> None:
                while pending:
                    pending.pop()(decision)

            try:
                async for chunk in self.paths[decision.path].run(request, request_id, leased, timings, encoder):
                    if chunk.finished:
                        # The engines are done with the stored embeddings: let go before the last
                        # answer goes out, so a client that then reads the store finds no lease.
                        self.references.release(leased)
                        chunk.serving_path = decision.path
                        if (load := self.cost.sample_load(mark)) is not None:
                            self._observe(decision.path, request, shape, chunk, timings, load, encodes)
                        tell()
                    yield chunk
                    tell()
            finally:
                try:
                    tell()
                finally:
                    self.cost.finished(decision.path)
        finally:
            self.references.release(leased)

    def _observe(
        self,
        path: str,
        request: GenerateRequest,
        shape: RequestShape,
        last: GenerationChunk,
        timings: dict[str, float],
        load: float,
        encodes: int,
    ) -> None:
        tokens = last.num_output_tokens
        if path == contract.DISAGGREGATED_PATH:
            self.cost.observe_disaggregated(shape, timings, tokens, load, encodes)
        elif request.stream:  # not streaming, the engine answers once: no first-token time
            self.cost.observe_colocated(shape, timings["prefill"], timings.get("decode", 0.0), tokens, load)
