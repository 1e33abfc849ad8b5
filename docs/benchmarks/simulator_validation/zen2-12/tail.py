"""The TTFT tail, real and simulated at the run's own speed: the requests with the five longest
real TTFTs (above the p95), each split into the wait before the forward that carried its prompt,
that forward, and the way back, beside the same request simulated (ttft_split.py of zen3-9's
first-text/, run with this session's cache); '-' where no forward matched the prompt (it
matches a forward holding a fresh chunk of the prompt's whole length, so a prompt prefilled in
several chunks shows only its TTFT). Needs the runs' forward logs (logs/, not in git).

    python docs/benchmarks/simulator_validation/zen2-12/tail.py CASE.json ...
"""
import importlib.util
import json
import sys
from pathlib import Path

X = Path(__file__).parent
SPLIT = X.parent / "zen3-9" / "first-text" / "ttft_split.py"
TOP = 5


def load_split():
    spec = importlib.util.spec_from_file_location("ttft_split", SPLIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.CACHE_DIR = "results/vz12"
    return module


def ms(part) -> str:
    return "      -" if part is None else f"{part * 1e3:7.0f}"


def main() -> None:
    split = load_split()
    profile = [str(X / "profile-threads1/profile.json")]
    for path in map(Path, sys.argv[1:]):
        case = json.loads(path.read_text())
        real, real_ttft = split.real_split(case)
        sim, sim_ttft = split.sim_split(case, profile, own=True)
        order = sorted(range(len(real_ttft)), key=lambda i: -(real_ttft[i] or 0))[:TOP]
        print(f"{path.parent.name}/{path.stem}: the {TOP} longest real TTFTs (ms: wait / "
              f"forward / back = TTFT; real | simulated at own speed; arrival s)")
        for i in order:
            cells = []
            for parts, ttft in ((real[i], real_ttft[i]), (sim[i], sim_ttft[i])):
                wait, fwd, end = parts if parts else (None, None, None)
                back = None if parts is None else ttft - end
                cells.append(f"{ms(wait)} {ms(fwd)} {ms(back)} = {ms(ttft)}")
            print(f"  #{i:3d} at {case['requests'][i]['arrival_s']:6.1f}: "
                  f"{cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
