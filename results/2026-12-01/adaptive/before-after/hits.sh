#!/usr/bin/env bash
# Targeted hit run (issue 14 item 1): c=1, identical + repeated, 12 requests.
cd /work/wt/adaptive
OUT=${1:-build/runs/hits-before}
env PYTHONPATH=/work/wt/adaptive .venv/bin/python -m bench run --interleave \
  --modes llm:identical epd:adaptive:identical epd:disaggregated:identical epd:colocated:identical \
          llm:repeated epd:adaptive:repeated epd:disaggregated:repeated epd:colocated:repeated \
  --baseline llm:identical --concurrency 1 --requests 12 --warmup 4 --output-tokens 32 \
  --prompt-tokens 32 --media-salt auto --prime-pool --no-progress --no-plots --out $OUT
