"""Prefill -> decode with KV transfer between two vLLM engines (Triton-free).

Modules: :mod:`.transfer` (the transfer parameters prefill hands decode; pure Python),
:mod:`.manifest` (a transfer's record in the node folder: layout, manifest, first token),
:mod:`.connector` (``TransferIdConnector``, loaded by vLLM inside each engine),
:mod:`.engine_args` (per-role engine args and their checks), :mod:`.kv_transfer` (what differs
per connector, one object chosen when an engine starts), :mod:`.engines` (``PrefillEngine`` /
``DecodeEngine`` wrappers), :mod:`.stage` (the ``prefill``/``decode`` models' inputs).

Why a connector of our own (``TransferIdConnector``) on CPU, and what was tried
--------------------------------------------------------------------------------
Requirements: prefill and decode are separate processes on one node (each Triton model
instance is its own process), CPU only, image inputs arrive as embeddings, and the decode
side must *prove* it used the transferred KV -- and fail loudly, never recompute silently,
when it cannot.

- ``ExampleConnector`` (vLLM's reference, safetensors files per layer): keys its folder by
  the prompt's token ids cut to whole KV blocks (128 tokens on CPU), so a prompt shorter
  than a block stores and loads nothing and decode silently recomputes (docs/facts.md), two
  prompts sharing their first blocks share a folder, it stores only the first chunk of a
  chunked prefill, never deletes anything, and returns 0 matched tokens -- i.e. recompute --
  on any miss. Measured here as well: its per-token indexing of the paged cache
  (``cache[block, :, offset]``) is wrong for vLLM's CPU attention backend, whose page
  keeps all K rows of a block and then all V rows (``[blocks, kv_heads, block_size,
  2*head_size]`` viewed as ``[.., 2*block_size, head_size]``): our first version copied
  tokens that way and decode diverged from colocated after 1-3 tokens on text prompts even
  though every check passed. We copy whole pages instead (layout-agnostic).
- ``NixlConnector`` with a CPU buffer: the production choice where UCX/RDMA or CUDA IPC
  exist (the ``gpu`` target). On this CPU node the ``nixl`` meta package (1.5.2) picks
  ``nixl-cu13`` because the standard torch build reports CUDA 13, and ``nixl-cu13==1.5.2``
  is not on PyPI; ``nixl_cu12`` 1.5.1 imported directly does create a UCX agent and
  registers CPU memory, but using it needs a shim for the ``nixl`` import name, a ZMQ side
  channel and port per engine, heartbeats/leases, and on CPU the worker pins itself with
  ``os.sched_setaffinity`` to the last core of each NUMA node -- on a 2-core machine shared
  by two engines that fights ``VLLM_CPU_OMP_THREADS_BIND``. Its transfer parameters
  (``remote_block_ids`` + host/port) are read as-is: a stale or tampered block list reads
  whatever now lives in those blocks, which a transfer must never do ("never garbage"). And its
  ``do_remote_prefill`` key makes vLLM report the *producer's* cached-token count as
  ``num_cached_tokens``, which removes the decode-side proof.
- LMCache / Mooncake (not tried): each brings its own package and a storage/transfer
  service (Mooncake's transfer engine targets RDMA); heavy for a 2-core CPU node, and
  both key KV by content (token hashes) like a cache, not by one request's hand-off.
- Offloading / SimpleCPUOffload: per-engine CPU offload of the engine's own prefix cache,
  not a producer -> consumer hand-off between engines.
- P2pNccl: NCCL, GPU only.

``TransferIdConnector`` keys every transfer by a random 128-bit id that travels in
``kv_transfer_params`` (not by prompt tokens), stores every prompt token (no block
rounding, every prefill chunk), commits with a manifest that binds token ids + multimodal
hashes with a digest, validates all of it on the decode side before loading, reports any
failure as a failed load (``kv_load_failure_policy="fail"`` -> ``finish_reason="error"``),
is single-use (decode deletes it) and expires unconsumed transfers. Files live on tmpfs
(``/dev/shm``), so a transfer is a memory copy on one node.

On GPUs (the ``gpu`` target) the KV moves with vLLM's ``NixlConnector``, GPU to GPU: the KV
stays in the prefill engine's blocks and Nixl's decode side reads them. The wrappers keep one
contract for both connectors (:class:`.transfer.TransferParams`: transfer id, prompt digest,
first token, and the connector's own ``kv_transfer_params`` handed to decode's request as they
are) and the same decode-side checks: for Nixl the prefill wrapper writes the transfer's
manifest (prompt ids, placeholders, image identities, a digest of Nixl's parameters) into the
node folder itself, so an unknown, reused or altered transfer (e.g. a tampered block list) is
refused before decode's engine sees it, and ``num_cached_tokens`` still proves the load (the
P-side cache count Nixl adds is dropped). Prefill runs two steps under Nixl so the first token's
KV is transferred too: decode's prompt is the prompt plus that token, and Nixl's decode side
must not hold more KV blocks than prefill hands over.
"""
