"""How often two engine-label journals give the same prompt the same label.

    python scripts/label_agreement.py A.jsonl B.jsonl [C.jsonl ...] [--json OUT]

Compares every pair of journals (`length_predictor/label_journal.py` format: a header line,
then {"id", "num_output_tokens", "finish_reason"} per prompt) over the prompt ids both hold:
the share with the same length, the same G = 200 bucket and the same G = 50 bucket (the
buckets of `length_predictor.buckets.Bucketing` under the journal's cap). Used to tell apart
where greedy labels differ between runs: the same CPU and batch, another batch, another CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from length_predictor.buckets import Bucketing


def read_journal(path: Path) -> tuple[dict, dict[int, int]]:
    """(header, id -> output tokens)."""
    header, labels = {}, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "header" in record:
            header = record["header"]
        else:
            labels[record["id"]] = record["num_output_tokens"]
    return header, labels


def agreement(a: dict[int, int], b: dict[int, int], cap: int) -> dict:
    common = sorted(set(a) & set(b))
    result = {"prompts": len(common),
              "same_length": sum(a[i] == b[i] for i in common)}
    for g in (200, 50):
        bucket = Bucketing(g, cap).bucket
        result[f"same_bucket_g{g}"] = sum(bucket(a[i]) == bucket(b[i]) for i in common)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("journals", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    journals = {p: read_journal(p) for p in args.journals}
    rows = []
    for (pa, (ha, la)), (pb, (hb, lb)) in itertools.combinations(journals.items(), 2):
        cap = ha.get("max_output_tokens") or hb.get("max_output_tokens") or 512
        row = {"a": str(pa), "b": str(pb), **agreement(la, lb, cap)}
        rows.append(row)
        n = max(row["prompts"], 1)
        print(f"{pa.name} vs {pb.name}: {row['prompts']} prompts; same length "
              f"{row['same_length']} ({100 * row['same_length'] / n:.0f}%), G=200 "
              f"{row['same_bucket_g200']} ({100 * row['same_bucket_g200'] / n:.0f}%), G=50 "
              f"{row['same_bucket_g50']} ({100 * row['same_bucket_g50'] / n:.0f}%)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
