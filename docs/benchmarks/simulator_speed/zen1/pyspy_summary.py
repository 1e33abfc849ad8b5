"""Summarise a py-spy raw (collapsed) profile: each function's share of the samples, inclusive
(it is anywhere on the stack) and own (it is on top).

    py-spy record -r 400 -f raw -o OUT -- .venv/bin/python \\
        docs/benchmarks/simulator_speed/zen1/run.py 100 100 60
    python docs/benchmarks/simulator_speed/zen1/pyspy_summary.py OUT [ROWS]
"""
import collections
import re
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3]) + "/"
FRAME = re.compile(r" \((.*?):\d+\)")  # "name (path:line)" -> "name (path relative to ROOT)"


def frames(stack: str) -> list[str]:
    return [FRAME.sub(lambda m: f" ({m.group(1).removeprefix(ROOT)})", f)
            for f in stack.split(";")]


def main(path: str, rows: int) -> None:
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            count = int(count)
            total += count
            names = frames(stack)
            for name in set(names):
                inclusive[name] += count
            own[names[-1]] += count
    print("total samples", total)
    for title, counter, limit in (("inclusive", inclusive, rows), ("own", own, 30)):
        print(f"--- {title}")
        for name, count in counter.most_common(limit):
            print(f"{100 * count / total:5.1f}% {name}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 45)
