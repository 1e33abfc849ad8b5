"""Summarise a py-spy raw (collapsed) profile: inclusive and own share per function.

    py-spy record -r 400 -f raw -o OUT -- .venv/bin/python docs/benchmarks/simulator_speed/zen1/run.py 100 100 60
    python docs/benchmarks/simulator_speed/zen1/pyspy_summary.py OUT 60
"""
import sys, re, collections
incl = collections.Counter(); own = collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(' ')
    n = int(n); total += n
    frames = [re.sub(r' \((.*?):\d+\)', lambda m: ' ('+m.group(1).split('/work/main/')[-1]+')', f) for f in stack.split(';')]
    for f in set(frames): incl[f] += n
    own[frames[-1]] += n
print('total samples', total)
print('--- inclusive'); [print(f'{100*v/total:5.1f}% {k}') for k, v in incl.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 45)]
print('--- own'); [print(f'{100*v/total:5.1f}% {k}') for k, v in own.most_common(30)]
