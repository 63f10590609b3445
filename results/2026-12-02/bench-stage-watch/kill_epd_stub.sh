#!/usr/bin/env bash
# The benchmark's stage watch, tried as a user meets it: `python -m bench run` starts its own
# server, epd's stub is SIGKILLed mid-run; the run must halt (exit 3), report what it could not
# measure, and its server must be stopped. Usage: kill_epd_stub.sh OUT_DIR (repository root).
set -u
OUT=${1:?out folder}
mkdir -p "$OUT"
.venv/bin/python -m bench run --modes llm epd --concurrency 2 --requests 16 --reps 30 --warmup 2 \
  --no-progress --no-plots --out "$OUT/run" > "$OUT/bench.log" 2>&1 &
BENCH=$!
until grep -q "epd c=2 rep 3/30" "$OUT/bench.log" 2>/dev/null; do
  kill -0 $BENCH 2>/dev/null || { echo "bench ended early"; exit 1; }
  sleep 1
done
STUB=$(pgrep -f "triton_python_backend_stub .*/epd/1/model.py" | head -1)
echo "[kill] $(date -u +%T.%N) SIGKILL epd stub pid $STUB" | tee -a "$OUT/events.log"
kill -9 "$STUB"
wait $BENCH
RC=$?
echo "[kill] $(date -u +%T.%N) bench exit code $RC" | tee -a "$OUT/events.log"
echo "[kill] tritonserver processes left: $(pgrep -c tritonserver || true)" | tee -a "$OUT/events.log"
cp build/bench/server.log "$OUT/server.log"
