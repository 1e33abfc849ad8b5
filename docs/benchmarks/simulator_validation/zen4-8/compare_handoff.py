"""The hand-off line with the median residual (handoff-median/, the code the runs ran) against
the mean (handoff-mean/, since 2026-11-29), case by case, both re-simulated from the same real
runs; the first lines check that the median replay gives the stored errors again.

    python docs/benchmarks/simulator_validation/zen4-8/compare_handoff.py > .../handoff_mean_vs_median.txt
"""
import json, glob, os
X = 'docs/benchmarks/simulator_validation/zen4-8'
M = ['ttft_mean', 'ttft_p99', 'tpot_mean', 'jct_mean', 'throughput_tokens']
def load(d, name):
    return json.load(open(f'{d}/{name}'))
tot = {k: [0, 0, 0, 0] for k in ('held', 'own')}
same = True
for sub in ('', 'sampled/'):
    for f in sorted(glob.glob(f'{X}/{sub}1P*.json')):
        name = os.path.basename(f)
        o, a, b = load(f'{X}/{sub}', name), load(f'{X}/handoff-median/{sub}', name), load(f'{X}/handoff-mean/{sub}', name)
        for key, get in (('held', lambda d: d['errors']), ('own', lambda d: d['own_speed']['errors'])):
            eo, ea, eb = get(o), get(a), get(b)
            same &= all(abs((eo[m]['relative_error'] or 0) - (ea[m]['relative_error'] or 0)) < 1e-9 for m in M)
            tot[key][0] += all(ea[m]['within_target'] for m in M); tot[key][1] += all(eb[m]['within_target'] for m in M)
            tot[key][2] += ea['tpot_mean']['within_target']; tot[key][3] += eb['tpot_mean']['within_target']
            print(f"{name[:26]:26} {key:4} TPOT {ea['tpot_mean']['relative_error']:+.1%} -> {eb['tpot_mean']['relative_error']:+.1%}  JCT {ea['jct_mean']['relative_error']:+.1%} -> {eb['jct_mean']['relative_error']:+.1%}  TTFT {ea['ttft_mean']['relative_error']:+.1%} -> {eb['ttft_mean']['relative_error']:+.1%}")
print('replay of median == stored:', same)
print({k: f'all five {v[0]} -> {v[1]}, TPOT {v[2]} -> {v[3]}' for k, v in tot.items()})
