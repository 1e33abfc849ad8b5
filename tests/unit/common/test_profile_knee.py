"""The recommended ChunkSize: where prefill throughput saturates, robust to one noisy point."""

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
