#!/usr/bin/env bash
# The cpu target's engines under three OpenMP settings, each run with its own server (run from
# the repository root with builders/targets.py *without* OMP_NUM_THREADS, i.e. before 2026-12-02's
# change: the variable then comes from this shell, which tritonserver and every stub inherit).
# Order run: omp1, default, passive, default2, omp1b (the same command; two of each to see the spread).
for variant in "$@"; do
  unset OMP_NUM_THREADS OMP_WAIT_POLICY
  case $variant in passive) export OMP_WAIT_POLICY=PASSIVE;; omp1*) export OMP_NUM_THREADS=1;; esac
  .venv/bin/python -m bench run --interleave --modes llm:unique epd:colocated:unique epd:disaggregated:unique llm:identical \
    --baseline llm:unique --concurrency 1 4 8 --requests 16 --reps 3 --warmup 4 --output-tokens 32 --prompt-tokens 32 \
    --media-salt auto --no-progress --no-plots --out /tmp/omp-ab/$variant > /tmp/omp-ab/$variant.log 2>&1
done
