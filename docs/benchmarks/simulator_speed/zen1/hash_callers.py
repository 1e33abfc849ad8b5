"""Count common.block_pool.hash_block calls by caller (three frames up) over a 100-instance
speed run with 1,000 requests: which path hashes how many blocks per request."""
import collections
import sys

import common.block_pool as bp
from simulator.hardware import hardware_costs
from simulator.run import simulate
from simulator.speed import speed_layout
from simulator.workload import synthetic

counts = collections.Counter()
original = bp.hash_block


def counted(parent, tokens):
    counts[tuple(sys._getframe(k).f_code.co_name for k in (2, 3, 4))] += 1
    return original(parent, tokens)


bp.hash_block = counted
report = simulate(speed_layout(100), hardware_costs("h100-llama2-7b"), synthetic(1000, 100, 0),
                  seed=0)
print("hashes", sum(counts.values()), "output tokens", report["total_output_tokens"])
for callers, count in counts.most_common():
    print(count, " <- ".join(callers))
