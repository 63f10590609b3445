#!/usr/bin/env bash
# Issue 14's path benchmark, 32 requests x 3 repetitions per point (runs 3 and 4 of 2026-12-02).
cd "$(git rev-parse --show-toplevel)"
OUT=${1:?out folder}
echo "[path-bench] start $(date -u +%T), HEAD $(git rev-parse --short HEAD), dirty: $(git status --porcelain | grep -v '^??' | wc -l)"
.venv/bin/python -m bench run --interleave \
  --modes llm:unique epd:adaptive:unique epd:disaggregated:unique epd:colocated:unique \
          llm:repeated epd:adaptive:repeated epd:disaggregated:repeated epd:colocated:repeated \
          llm:identical epd:adaptive:identical epd:disaggregated:identical epd:colocated:identical \
  --baseline llm:unique --concurrency 1 4 8 --requests 32 --reps 3 --warmup 4 --max-noise 0.25 --noise-retries 1 --output-tokens 32 \
  --prompt-tokens 32 --media-salt auto --prime-pool --time-budget 3600 --no-progress --out $OUT
echo "[path-bench] bench rc=$? at $(date -u +%T)"
.venv/bin/python -m bench.path_acceptance $OUT
echo "[path-bench] done at $(date -u +%T)"
