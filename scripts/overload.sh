#!/usr/bin/env bash
# A burst of 10x capacity for 60 s against a cluster with admission limits (issue 10).
# Usage: scripts/overload.sh OUT_DIR [CAPACITY]   (CAPACITY defaults to the soak's measurement)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/overload}
CAPACITY=${2:-$(sed -n 's/capacity: \(.*\) req\/s/\1/p' docs/benchmarks/soak/capacity.txt 2>/dev/null || echo 1.0)}
PORT=8192
mkdir -p "$OUT"
# The prompt-token bound sets the admitted TTFT: one single-thread prefill instance drains about
# 650 tokens/s here, so 4096 queued tokens wait about 6 s (8192 let p99 TTFT reach 15 s).
.venv/bin/splitserve up --port $PORT --max-in-flight 16 --max-prefill-queue-tokens ${QUEUE_TOKENS:-4096} \
   --log-dir "$OUT/logs" > "$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
until curl -sf localhost:$PORT/health > /dev/null; do sleep 1; done
.venv/bin/python -m bench.overload --url http://127.0.0.1:$PORT --capacity "$CAPACITY" \
   --factor 10 --seconds 60 --out "$OUT"
