"""One simulator.speed configuration, timed: INSTANCES RATE SECONDS -> CPU s, events, forwards."""
import sys
import time

from simulator.hardware import hardware_costs
from simulator.run import simulate
from simulator.speed import speed_layout
from simulator.workload import synthetic

instances, rate, duration = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
requests = synthetic(int(rate * duration), rate, 0)
start = time.process_time()
report = simulate(speed_layout(instances), hardware_costs("h100-llama2-7b"), requests, seed=0)
print("cpu", time.process_time() - start, report["simulation"]["events"],
      report["simulation"]["forwards"])
