#!/bin/bash
# Interleaved A/B of simulator.speed's CPU time: BASE (a worktree at the commit before) and
# NEW (this tree), N rounds, one configuration per call. Usage (from the repository root):
#   BASE=/tmp/base docs/benchmarks/simulator_speed/zen1/ab_speed.sh N INSTANCES RATE DURATION
# Prints: tree, CPU s, events, forwards, output tokens, requests finished.
N=$1; shift
PY=${PY:-.venv/bin/python}; PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # the venv's own path
for i in $(seq "$N"); do
  for tree in "$BASE" "$PWD"; do
    (cd "$tree" && "$PY" -c "
from simulator.speed import measure
r = measure($1, $2, $3)
print('$(basename "$tree")', round(r['cpu_s'], 3), r['events'], r['forwards'],
      r['output_tokens'], r['num_ok'])")
  done
done
