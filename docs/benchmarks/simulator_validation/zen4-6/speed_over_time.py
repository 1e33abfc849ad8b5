"""The same kind of forward, run after run: each real run's batch-1 decode steps and its
prompt-carrying forwards, measured over the profile's price (the forward classes the case files
record), in the order the runs started. Usage: python speed_over_time.py DIR [DIR...]"""
import glob
import json
import os
import sys

rows = []
for directory in sys.argv[1:]:
    for path in glob.glob(os.path.join(directory, "*.json")):
        case = json.load(open(path))
        if "forward_classes" not in case:
            continue
        classes = case["forward_classes"]["classes"]
        b1 = classes.get("decode b1", {})
        speed = case.get("own_speed") or case
        rows.append((case["real"]["uptime_before"][:8], os.path.basename(path)[:-5],
                     case["profile"]["threads"], b1.get("real_over_model"),
                     b1.get("real_forwards", 0), speed["factor"], speed["prompt_factor"]))
print("started  run                                    threads  b1 real/model (forwards)  "
      "k decode  k prompt")
for started, name, threads, b1, count, k, kp in sorted(rows):
    b1_text = f"{b1:.3f} ({count})" if b1 else "-"
    print(f"{started} {name:40s} {threads}        {b1_text:24s}  {k:.3f}     {kp or 0:.3f}")
