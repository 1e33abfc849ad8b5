"""One simulator.speed configuration, timed (CPU s, events, forwards): INSTANCES RATE SECONDS."""
import sys, time
from simulator.speed import speed_layout
from simulator.hardware import hardware_costs
from simulator.run import simulate
from simulator.workload import synthetic
n, rate, dur = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
reqs = synthetic(int(rate * dur), rate, 0)
t = time.process_time()
rep = simulate(speed_layout(n), hardware_costs("h100-llama2-7b"), reqs, seed=0)
print("cpu", time.process_time() - t, rep["simulation"]["events"], rep["simulation"]["forwards"])
