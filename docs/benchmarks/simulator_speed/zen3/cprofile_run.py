"""cProfile of the speed configuration; prints top functions by own and cumulative time."""
import cProfile, pstats, sys, time
from simulator.speed import speed_layout
from simulator.hardware import hardware_costs
from simulator.run import simulate
from simulator.workload import synthetic
n, rate, dur = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
reqs = synthetic(int(rate * dur), rate, 0)
prof = cProfile.Profile()
t = time.process_time()
prof.enable()
rep = simulate(speed_layout(n), hardware_costs("h100-llama2-7b"), reqs, seed=0)
prof.disable()
print("cpu", time.process_time() - t, rep["simulation"]["events"], rep["simulation"]["forwards"])
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumulative").print_stats(45)
