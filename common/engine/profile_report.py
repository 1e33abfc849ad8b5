"""What `splitserve profile` leaves behind for a reader: the report as JSON, the prefill and
decode curves as a PNG (matplotlib), and the summary lines it prints.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile.json").write_text(json.dumps(report, indent=2))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["tokens"] for r in report["prefill"]],
              [r["tokens_per_s"] for r in report["prefill"]], marker="o")
    left.axvline(report["recommended_chunk_size"], color="red", linestyle="--",
                 label=f"ChunkSize {report['recommended_chunk_size']}")
    left.set(xscale="log", xlabel="tokens per forward", ylabel="prefill tokens/s",
             title=f"Prefill ({report['model']}, {report['dtype']})")
    left.legend()
    right.plot([r["batch"] for r in report["decode"]],
               [r["tokens_per_s"] for r in report["decode"]], marker="o")
    right.set(xscale="log", xlabel="decode batch size", ylabel="decode tokens/s",
              title=f"Decode ({report['decode_context']} tokens of context)")
    fig.tight_layout()
    fig.savefig(out_dir / "profile.png", dpi=120)
    plt.close(fig)


def print_summary(report: dict) -> None:
    r = report["ratios"]
    lines = [f"recommended ChunkSize: {report['recommended_chunk_size']} tokens",
             f"prefill at ChunkSize: {r['prefill_fraction_of_matmul_rate']:.2f} x measured "
             f"{report['dtype']} matmul rate"]
    if "decode_batch1_over_weight_stream" in r:
        lines.append(f"decode batch 1: {r['decode_batch1_over_weight_stream']:.2f} x the time to "
                     f"read the weights once ({r['weight_stream_seconds'] * 1e3:.1f} ms)")
    for row in report["decode"]:
        if row["batch"] in (1, 32, 128):
            lines.append(f"decode batch {row['batch']}: {row['step_over_floor']:.2f} x its floor "
                         f"({row['floor_seconds'] * 1e3:.1f} ms); sampled (temperature 0.7, "
                         f"top_p 0.95) {row['sampled_over_greedy']:.2f} x the greedy step")
    for row in report.get("hf_decode", {}).get("ratios", []):
        lines.append(f"decode batch {row['ours_batch']} vs transformers generate batch "
                     f"{row['hf_batch']}: {row['speedup']:.2f}x tokens/s")
    print("\n".join(lines))
