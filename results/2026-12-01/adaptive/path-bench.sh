#!/usr/bin/env bash
# Issue 14's benchmark: ONE interleaved run (README's command, 16 requests per point), time budget
# cut so the run ends before 08:30 UTC; refuses to start after 07:40 UTC.
cd /work/wt/adaptive
now=$(date -u +%s); gate=$(date -u -d '07:40' +%s); end=$(date -u -d '08:24' +%s)
echo "[path-bench] slot at $(date -u +%T), HEAD $(git rev-parse --short HEAD), dirty: $(git status --porcelain | grep -v '^??' | wc -l)"
if [ "$now" -gt "$gate" ]; then echo "[path-bench] past 07:40 UTC: not started"; exit 3; fi
budget=$(( end - now - 420 )); [ $budget -gt 3000 ] && budget=3000
echo "[path-bench] time budget $budget s"
OUT=results/2026-12-01/adaptive/bench
env PYTHONPATH=/work/wt/adaptive .venv/bin/python -m bench run --interleave \
  --modes llm:unique epd:adaptive:unique epd:disaggregated:unique epd:colocated:unique \
          llm:repeated epd:adaptive:repeated epd:disaggregated:repeated epd:colocated:repeated \
          llm:identical epd:adaptive:identical epd:disaggregated:identical epd:colocated:identical \
  --baseline llm:unique --concurrency 1 4 8 --requests 16 --warmup 4 --output-tokens 32 \
  --prompt-tokens 32 --media-salt auto --prime-pool --time-budget $budget --no-progress --out $OUT
rc=$?
echo "[path-bench] bench rc=$rc at $(date -u +%T)"
env PYTHONPATH=/work/wt/adaptive .venv/bin/python -m bench.path_acceptance $OUT
echo "[path-bench] done at $(date -u +%T)"
