"""How much of each real run's prompt tokens its instances found cached: the prompt tokens the
forward log's forwards computed within the load window against the requests' prompt tokens, and
how many prompts started fresh (context 0). Needs the forward logs (kept out of git).

    python docs/benchmarks/simulator_validation/zen5-11/cached_prompts.py [DIR]
"""
import glob
import json
import sys
from pathlib import Path

directory = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
for path in sorted(directory.glob("*-s[0-2]*.json")):
    case = json.loads(path.read_text())
    start, end = case["real"]["load_window"]
    fresh = computed = 0
    for log in glob.glob(case["real"]["forward_log"] + "/*.jsonl"):
        for text in open(log):
            line = json.loads(text)
            if start <= line["time"] <= end and line["prompts"]:
                fresh += len(line["fresh"])
                computed += line["tokens"] - line["decodes"]
    total = sum(r["prompt_tokens"] for r in case["requests"])
    print(f"{path.stem}: {fresh} of {len(case['requests'])} prompts fresh, {computed} of "
          f"{total} prompt tokens computed ({1 - computed / total:.1%} cached)")
