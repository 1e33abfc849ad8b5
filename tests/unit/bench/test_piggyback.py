"""bench.piggyback (E2): the per-token arithmetic over a timing double, and the summary."""

from __future__ import annotations

import pytest

from bench.piggyback import Shape, format_table, measure_shape, summarize


class FakeBench:
    """Forwards whose time is 1 ms per prefill token + 10 ms per decode-only forward of any
    size, and 0.5 ms more per decode riding on a prefill chunk (a unit-test double)."""

    def decode(self, context: int) -> tuple:
        return ("decode", context)

    def prompt(self, n: int) -> tuple:
        return ("prompt", n)

    def seconds(self, chunks: list, repeats: int) -> float:
        prompts = [n for kind, n in chunks if kind == "prompt"]
        decodes = len(chunks) - len(prompts)
        if not prompts:
            return 0.010
        return 1e-3 * sum(prompts) + 0.5e-3 * decodes


def test_per_token_costs_and_speedup():
    row = measure_shape(FakeBench(), Shape(100, 4, 5, 64), repeats=1)
    assert row["per_prefill_token_ms"] == pytest.approx(1.0)
    assert row["per_decode_token_alone_ms"] == pytest.approx(10 / 5)
    assert row["per_decode_token_piggybacked_ms"] == pytest.approx(0.5)
    assert row["speedup"] == pytest.approx(4.0)


def test_summary_has_mean_and_range_and_the_table_names_the_shape():
    runs = [{"per_prefill_token_ms": v, "per_decode_token_alone_ms": 2 * v,
             "per_decode_token_piggybacked_ms": v / 2, "speedup": s}
            for v, s in ((1.0, 4.0), (3.0, 2.0))]
    summary = summarize(runs)
    assert summary["speedup"] == {"mean": 3.0, "min": 2.0, "max": 4.0}
    result = {"summary": {"8+2": summary},
              "shapes": {"8+2": {"chunk": 8, "decodes": 2, "context": 16,
                                 "decode_only_batch": 3}}}
    assert "| 8-token chunk + 2 decodes of 16 vs decode-only batch 3 |" in format_table(result)
    assert "3.0x (2.0-4.0)" in format_table(result)
