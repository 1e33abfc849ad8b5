"""`splitserve profile`: the recommended ChunkSize (where prefill throughput saturates, robust
to one noisy point), the mixed rows, and how many times a shape is timed."""

import math

from common.engine.profile import knee

SIZES = [16, 32, 64, 96, 128, 192, 256, 512]


def test_knee_is_the_first_size_within_90_percent_of_the_best():
    # 90% of 1400 is 1260: 128 tokens (1300) is the first size at or above it.
    assert knee(SIZES, [300, 600, 900, 1200, 1300, 1400, 1380, 1200]) == 128


def test_a_noisy_fast_point_below_the_saturation_is_not_the_knee():
    # 64 tokens came out fast once (1267), 96 did not: the throughput has not saturated at 64.
    assert knee(SIZES, [604, 900, 1267, 1166, 1374, 1356, 1315, 1272]) == 128


def test_the_knee_is_the_best_size_when_nothing_below_comes_close():
    assert knee(SIZES, [100, 200, 300, 400, 500, 600, 700, 1000]) == 512


def test_the_mixed_rows_cover_the_short_prompts_a_lightly_loaded_instance_mixes():
    from common.engine.profile import ProfileOptions, mixed_shapes

    sizes, batches = mixed_shapes(ProfileOptions())
    assert sizes[:2] == [16, 64] and 1024 in sizes and batches == [1, 16]
    assert mixed_shapes(ProfileOptions(max_prefill_tokens=100))[0] == [16, 64]
    assert mixed_shapes(ProfileOptions(max_prefill_tokens=8))[0] == [4]  # half the largest


class _Clock:
    """A fake perf_counter that a timed call advances by its own `step`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _count_timed(monkeypatch, step: float, repeats: int) -> tuple[float, int]:
    from common.engine import profile

    clock, calls = _Clock(), []
    monkeypatch.setattr(profile.time, "perf_counter", clock)

    def call() -> None:
        calls.append(1)
        clock.now += step * (2 if len(calls) == 2 else 1)  # one slow sample: the median ignores it

    return profile._timed(call, repeats), len(calls)


def test_short_forwards_are_timed_until_the_samples_add_up_to_the_minimum(monkeypatch):
    from common.engine.profile import MIN_MEASURED_S

    step = 2.0 ** -6  # a power of two: the clock's sums are exact
    median, calls = _count_timed(monkeypatch, step, 3)
    # one warm-up, then samples until they sum to MIN_MEASURED_S (the first counts twice)
    assert calls == 1 + math.ceil(MIN_MEASURED_S / step) - 1 and median == step


def test_long_forwards_take_the_repeats_and_tiny_ones_stop_at_the_cap(monkeypatch):
    from common.engine.profile import MAX_SAMPLES

    assert _count_timed(monkeypatch, 1.0, 3) == (1.0, 4)
    assert _count_timed(monkeypatch, 1.0, 5) == (1.0, 6)
    assert _count_timed(monkeypatch, 2.0 ** -20, 3) == (2.0 ** -20, 1 + MAX_SAMPLES)
