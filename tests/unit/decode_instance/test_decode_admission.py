"""Decode admission policies as pure functions (TetriInfer §3.4)."""

from __future__ import annotations

from common.config import PredictionConfig
from common.protocol import LengthPrediction
from decode_instance.admission import SeqView, make_admission, migrate


def view(tokens, output=0, lower=None, width=200):
    hint = None if lower is None else LengthPrediction(lower // width, lower, lower + width)
    return SeqView(tokens, output, hint)


def test_greedy_admits_while_the_prompt_fits_now():
    greedy = make_admission("greedy")
    assert greedy.admits(view(31), [], free_blocks=2, total_blocks=10, block_size=16)
    assert not greedy.admits(view(32), [], free_blocks=2, total_blocks=10, block_size=16)


def test_reserve_static_needs_the_predicted_total_now():
    rs = make_admission("reserve-static")
    new = view(32, lower=200)  # (32 + 200) / 16 -> 15 blocks
    assert rs.admits(new, [], free_blocks=15, total_blocks=100, block_size=16)
    assert not rs.admits(new, [], free_blocks=14, total_blocks=100, block_size=16)
    upper = make_admission("reserve-static", PredictionConfig(use_upper_end=True))
    assert not upper.admits(new, [], free_blocks=15, total_blocks=100, block_size=16)
    assert rs.admits(view(32), [], free_blocks=3, total_blocks=100, block_size=16)  # no hint


def test_reserve_dynamic_looks_at_the_shortest_remaining_job():
    rd = make_admission("reserve-dynamic")
    running = [view(100, output=150, lower=200), view(50, output=0, lower=400)]
    # r_min = 200 - 150 = 50: (100+50)/16=10, (50+50)/16=7, new (40+50)/16=6 -> 23 blocks
    new = view(40, lower=400)
    assert rd.admits(new, running, free_blocks=20, total_blocks=23, block_size=16)
    assert not rd.admits(new, running, free_blocks=20, total_blocks=22, block_size=16)
    assert not rd.admits(view(400, lower=0), running, free_blocks=20, total_blocks=1000,
                         block_size=16)  # must also fit right now


def test_sequences_that_outgrow_their_bucket_move_on():
    hint = LengthPrediction(1, 200, 400)
    assert migrate(hint, 399) == hint
    assert migrate(hint, 400) == LengthPrediction(2, 400, 600)
    assert migrate(hint, 1050) == LengthPrediction(5, 1000, 1200)
    assert migrate(None, 5) is None
