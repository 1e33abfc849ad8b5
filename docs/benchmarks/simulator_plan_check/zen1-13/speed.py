"""How fast each real run of the plan checks ran against the profile the simulation priced it
with: per run, k = measured / modelled seconds of its decode steps and of its prompt-carrying
forwards (simulator.calibrate.from_forwards), of wall time and, for a layout of more 1-thread
instances than the two cores, of the work each forward did (the shared-cores model read
backwards). k near 1 against work but above 1 against wall: the sharing explains the
slowdown; above 1 against work too: this VM (or the front end) ran slower than the profile.
Needs the runs' forward logs (logs/, not in git).

    python docs/benchmarks/simulator_plan_check/zen1-13/speed.py FILE.json ...
"""
import json
import sys

from simulator.calibrate import case_lines, from_forwards, run_logs
from simulator.plan import Candidate
from simulator.validate import load_profiles, profile_for

CORES = 2
# the checks' --profile (results/vc13/profile.json) was a copy of this record
PROFILE = "docs/benchmarks/simulator_validation/zen1-10/profile-threads1/profile.json"

costs, _ = profile_for(load_profiles([PROFILE]), 1)
for path in sys.argv[1:]:
    result = json.load(open(path))
    print(f"{result['workload']} ({path})")
    layouts = {row["candidate"]: row["layout"] for row in result["simulated"]}
    for real in result["real"]:
        instances = Candidate(**layouts[real["candidate"]]).instances
        for run in real["runs"]:
            lines = case_lines(run, run_logs(run))
            wall = from_forwards(lines, costs)
            text = (f"  {real['candidate']:<8} seed {run['seed']}: {wall['forwards']} forwards, "
                    f"k decode {wall['factor']:.2f} prompt {wall['prompt_factor']:.2f} (wall)")
            if instances > CORES:
                work = from_forwards(lines, costs, cores=CORES)
                text += (f"; {work['factor']:.2f} / {work['prompt_factor']:.2f} (work on "
                         f"{CORES} cores)")
            print(text)
