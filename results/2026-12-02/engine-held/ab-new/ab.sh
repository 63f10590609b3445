#!/bin/bash
# A/B: llm vs epd colocated (unique + identical), c=1 and 8, on the checked-out tree.
cd "$(git rev-parse --show-toplevel)"
.venv/bin/python -m bench run --interleave --modes llm:unique epd:colocated:unique llm:identical epd:colocated:identical --baseline llm:unique --concurrency 1 8 --requests 24 --reps 3 --warmup 4 --output-tokens 32 --prompt-tokens 32 --media-salt auto --prime-pool --no-progress --no-plots --out $1 > $1.log 2>&1
python3 - "$1" <<'PY'
import csv,sys
for r in csv.DictReader(open(sys.argv[1]+'/results.csv')):
    print(f"{r['mode']:26s} {r['load_label']:4s} ttft {float(r['ttft_ms_p50']):7.1f} e2e {float(r['e2e_ms_p50']):7.1f} other {float(r['other_processes_cpu_share']):.2f}")
PY
