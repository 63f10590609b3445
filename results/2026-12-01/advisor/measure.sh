#!/usr/bin/env bash
# The measurement the advisor's CPU profile is fitted on and checked against (run from the repo root).
# Waits (up to 10 min) for other work to leave the CPUs, since the 2-core machine is shared.
set -euo pipefail
OUT=results/2026-12-01/advisor/measured
uptime  # the load at the start
PYTHONPATH=$PWD .venv/bin/python -c "from bench.peers import wait_for_quiet; print(wait_for_quiet(600, 0.25))"
PYTHONPATH=$PWD .venv/bin/python -m bench run --out "$OUT" \
  --title "advisor: llm and epd (unique, repeated) at c=1,2,4,8 for the simulator fit" \
  --modes llm llm:repeated epd epd:repeated --concurrency 1 2 4 8 \
  --requests 24 --warmup 4 --reps 2 --prime-pool --max-noise 0.3 --noise-retries 2 \
  --time-budget 900 --media-salt auto --no-progress
uptime
