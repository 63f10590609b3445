#!/usr/bin/env bash
# Issue 14's path benchmark, REQUESTS x REPS per point (default 32 x 3: runs 3-9 of 2026-12-02;
# run 10 on: 24 x 8, with --interleave running the modes' repetitions round by round; run 17 on:
# with llm:<media>:again, the control: llm measured again in the same rounds on requests of its own).
cd "$(git rev-parse --show-toplevel)"
OUT=${1:?out folder}
REPS=${REPS:-3}
REQUESTS=${REQUESTS:-32}
echo "[path-bench] start $(date -u +%T), HEAD $(git rev-parse --short HEAD), dirty: $(git status --porcelain | grep -v '^??' | wc -l)"
.venv/bin/python -m bench run --interleave \
  --modes llm:unique epd:adaptive:unique epd:disaggregated:unique epd:colocated:unique llm:unique:again \
          llm:repeated epd:adaptive:repeated epd:disaggregated:repeated epd:colocated:repeated llm:repeated:again \
          llm:identical epd:adaptive:identical epd:disaggregated:identical epd:colocated:identical llm:identical:again \
  --baseline llm:unique --concurrency 1 4 8 --requests $REQUESTS --reps $REPS --warmup 4 --max-noise 0.25 --noise-retries 1 --output-tokens 32 \
  --prompt-tokens 32 --media-salt auto --prime-pool --time-budget 3600 --no-progress --out $OUT
echo "[path-bench] bench rc=$? at $(date -u +%T)"
.venv/bin/python -m bench.path_acceptance $OUT
echo "[path-bench] done at $(date -u +%T)"
