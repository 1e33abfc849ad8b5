"""Golden choices of the length-aware dispatch policies on hand-built cluster states."""

from __future__ import annotations

from collections import Counter

from common.config import PredictionConfig
from common.protocol import LengthPrediction, PeerInfo
from common.sampling_params import SamplingParams
from common.sequence import Sequence
from prefill_instance.dispatcher import (
    DispatchOptions,
    Imbalance,
    LeastLoaded,
    PowerOfTwo,
    PowerOfTwoRatio,
    RandomChoice,
    heavy_light_ratio,
)

OPTIONS = DispatchOptions(PredictionConfig(heavy_threshold=128), block_size=16, seed=1)


def peer(name, free=100, heavy=0, light=0, running=0):
    return PeerInfo(name, f"tcp://{name}", "", num_free_blocks=free, num_total_blocks=200,
                    num_running=running, num_heavy=heavy, num_light=light)


def seq(prompt=100, predicted=None):
    s = Sequence("s", list(range(prompt)), SamplingParams(), max_model_len=4096)
    if predicted is not None:
        s.meta.prediction = LengthPrediction(predicted // 200, predicted, predicted + 200)
    return s


def test_power_of_two_sends_heavy_to_fewer_heavy_and_light_to_fewer_decodes():
    decodes = [peer("a", heavy=3, light=1), peer("b", heavy=1, light=3)]
    choices = Counter(PowerOfTwo(OPTIONS).pick(seq(predicted=400), decodes).instance_id
                      for _ in range(20))
    assert choices == {"b": 20}  # with two in alpha, both are always sampled
    light = PowerOfTwo(OPTIONS).pick(seq(predicted=50), [peer("a", heavy=0, light=5),
                                                         peer("b", heavy=2, light=1)])
    assert light.instance_id == "b"  # b runs 3 decodes after placement, a would run 6
    tie = PowerOfTwo(OPTIONS).pick(seq(predicted=50), [peer("a", heavy=2, light=1),
                                                       peer("b", heavy=1, light=2)])
    assert tie.instance_id == "b"  # equal counts: the one with fewer heavy decodes


def test_literal_ratio_rule_picks_lower_heavy_light_ratio_after_placement():
    light = PowerOfTwoRatio(OPTIONS).pick(seq(predicted=50), [peer("a", heavy=0, light=5),
                                                              peer("b", heavy=2, light=1)])
    assert light.instance_id == "a"  # a -> 0 heavy : 6 light = 0; b -> 2 : 2 = 1
    assert heavy_light_ratio(peer("x", heavy=1, light=1), heavy=True) == 2.0


def place(policy, kinds: str) -> dict[str, tuple[int, int]]:
    """Place heavy (H) and light (L) decodes on two instances that never finish any."""
    counts = {"a": (0, 0), "b": (0, 0)}
    for kind in kinds:
        decodes = [peer(n, heavy=h, light=li) for n, (h, li) in counts.items()]
        choice = policy.pick(seq(predicted=400 if kind == "H" else 50), decodes).instance_id
        h, li = counts[choice]
        counts[choice] = (h + (kind == "H"), li + (kind == "L"))
    return counts


def test_power_of_two_balances_heavy_and_total_where_the_ratio_rule_piles_up():
    kinds = "HLHHLLLHHLHLHHHL" * 4  # 36 heavy, 28 light
    (ha, la), (hb, lb) = place(PowerOfTwo(OPTIONS), kinds).values()
    assert abs(ha - hb) <= 1 and abs((ha + la) - (hb + lb)) <= 2
    (ha, la), (hb, lb) = place(PowerOfTwoRatio(OPTIONS), kinds).values()
    assert abs((ha + la) - (hb + lb)) > 16  # the literal rule's feedback loop


def test_power_of_two_alpha_set_and_fallbacks():
    needy = seq(prompt=1000, predicted=600)  # (1000 + 600) / 16 = 100 blocks
    roomy, tight = peer("roomy", free=120), peer("tight", free=50)
    assert PowerOfTwo(OPTIONS).pick(needy, [tight, roomy]).instance_id == "roomy"
    beta_only = [peer("x", free=40), peer("y", free=60)]
    assert PowerOfTwo(OPTIONS).pick(needy, beta_only).instance_id == "y"  # roomiest in beta
    holding = PowerOfTwo(DispatchOptions(hold_when_full=True, block_size=16))
    assert holding.pick(needy, beta_only) is None
    assert PowerOfTwo(OPTIONS).pick(needy, []) is None


def test_power_of_two_spreads_heavy_decodes():
    decodes = {name: peer(name) for name in "abcd"}
    policy = PowerOfTwo(OPTIONS)
    for _ in range(32):
        choice = policy.pick(seq(predicted=400), list(decodes.values()))
        decodes[choice.instance_id] = peer(choice.instance_id, heavy=choice.num_heavy + 1)
    counts = [p.num_heavy for p in decodes.values()]
    assert sum(counts) == 32 and max(counts) <= 11 and min(counts) >= 5, counts


def test_imbalance_sends_every_heavy_decode_to_one_instance():
    decodes = [peer("c"), peer("a"), peer("b")]
    policy = Imbalance(OPTIONS)
    heavy = {policy.pick(seq(predicted=500), decodes).instance_id for _ in range(10)}
    light = Counter(policy.pick(seq(predicted=10), decodes).instance_id for _ in range(10))
    assert heavy == {"a"} and set(light) == {"b", "c"}


def test_random_and_least_loaded():
    decodes = [peer("a", free=10), peer("b", free=90, running=3), peer("c", free=90, running=1)]
    assert LeastLoaded(OPTIONS).pick(seq(), decodes).instance_id == "c"
    policy = RandomChoice(OPTIONS)
    picks = {policy.pick(seq(), decodes).instance_id for _ in range(50)}
    assert picks == {"a", "b", "c"}
