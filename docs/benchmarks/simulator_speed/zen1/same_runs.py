"""Fingerprint whole simulations (traces, reports, flips, free lists) so two trees can be
compared: cd TREE && PYTHONPATH=TREE python same_runs.py > TREE.txt, then diff the outputs."""
import hashlib
import json
import sys

sys.path.insert(0, "tests")
from simulator.hardware import hardware_costs
from simulator.run import simulate, without_wall_time
from simulator.speed import speed_layout
from simulator.workload import synthetic
from unit.simulator.test_steady import CASES, fingerprint, run


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


for name, lay in CASES.items():
    for steady in (True, False):
        print(digest(fingerprint(run(lay, steady))), f"{name}/{steady}")
report = without_wall_time(simulate(speed_layout(20), hardware_costs("h100-llama2-7b"),
                                    synthetic(1200, 20, 1), seed=1))
report["simulation"].pop("events", None)
print(digest(report), "speed20")
