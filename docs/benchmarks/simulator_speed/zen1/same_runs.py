"""Fingerprint whole simulations (traces, reports, flips, free lists) so two trees can be compared:
    cd TREE && PYTHONPATH=TREE python same_runs.py > TREE.txt   (then diff the two outputs)"""
import hashlib, json, sys
sys.path.insert(0, "tests")
from unit.simulator.test_steady import CASES, run, fingerprint
from simulator.speed import speed_layout
from simulator.hardware import hardware_costs
from simulator.run import simulate, without_wall_time
from simulator.workload import synthetic
out = {}
for name, lay in CASES.items():
    for steady in (True, False):
        fp = fingerprint(run(lay, steady))
        out[f"{name}/{steady}"] = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]
rep = simulate(speed_layout(20), hardware_costs("h100-llama2-7b"), synthetic(1200, 20, 1), seed=1)
rep = without_wall_time(rep); rep["simulation"].pop("events", None)
out["speed20"] = hashlib.sha256(json.dumps(rep, sort_keys=True, default=str).encode()).hexdigest()[:16]
for k, v in out.items(): print(v, k)
