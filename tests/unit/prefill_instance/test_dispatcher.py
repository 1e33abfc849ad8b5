"""The round-robin dispatcher: which decode instance gets each prefilled sequence."""

from __future__ import annotations

from common.plugins import DISPATCH_POLICIES
from common.protocol import PeerInfo
from common.sampling_params import SamplingParams
from common.sequence import Sequence
from prefill_instance.dispatcher import Dispatcher, RoundRobin


def peer(instance_id, free=0):
    return PeerInfo(instance_id, f"tcp://{instance_id}:1", f"tcp://{instance_id}:2",
                    num_free_blocks=free)


def seq(seq_id="s", prompt_len=4):
    return Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(), max_model_len=100,
                    arrival_time=0.0)


def picks(dispatcher, decodes, n):
    return [dispatcher.pick(seq(f"s{i}"), decodes).instance_id for i in range(n)]


def test_registered_by_name():
    assert DISPATCH_POLICIES.get("round_robin") is RoundRobin
    assert isinstance(RoundRobin(), Dispatcher)


def test_cycles_in_instance_id_order_whatever_the_view_order():
    decodes = [peer("decode-2"), peer("decode-0"), peer("decode-1")]
    rr = RoundRobin()
    assert picks(rr, decodes, 7) == ["decode-0", "decode-1", "decode-2"] * 2 + ["decode-0"]


def test_returns_the_peer_object_from_the_view():
    decodes = [peer("b", free=5), peer("a", free=9)]
    choice = RoundRobin().pick(seq(), decodes)
    assert choice is decodes[1] and choice.num_free_blocks == 9


def test_no_decodes_gives_none_and_does_not_advance():
    rr = RoundRobin()
    assert rr.pick(seq(), []) is None
    assert rr.pick(seq(), []) is None
    assert picks(rr, [peer("x"), peer("y")], 3) == ["x", "y", "x"]


def test_single_decode_always_chosen():
    assert picks(RoundRobin(), [peer("only")], 4) == ["only"] * 4


def test_keeps_cycling_when_the_list_changes():
    rr = RoundRobin()
    three = [peer("a"), peer("b"), peer("c")]
    assert picks(rr, three, 2) == ["a", "b"]
    # "b" leaves, "d" joins: the counter carries on over the new list, never failing
    changed = [peer("d"), peer("a"), peer("c")]
    assert picks(rr, changed, 4) == ["d", "a", "c", "d"]  # sorted: a, c, d; counter at 2
    # shrinking to fewer instances than the counter still picks members of the new list
    assert picks(rr, [peer("c")], 2) == ["c", "c"]
    two = [peer("a"), peer("c")]
    got = picks(rr, two, 4)
    assert set(got) == {"a", "c"} and got[0] != got[1] and got[:2] == got[2:]
    # an empty view in between holds the sequence (None) and the cycle resumes afterwards
    assert rr.pick(seq(), []) is None
    assert picks(rr, two, 2) == got[:2]


def test_power_of_two_puts_the_prefix_holder_in_the_pair_and_prefers_it_on_equal_load():
    from prefill_instance.dispatcher import DispatchOptions, PowerOfTwo

    decodes = [peer(f"d{i}", free=100) for i in range(6)]
    cached = seq("turn-2")
    cached.meta.decode_cached = {"d4": 64}
    for seed in range(20):  # whichever two the draw picks, d4 competes and wins on equal load
        assert PowerOfTwo(DispatchOptions(seed=seed)).pick(cached, decodes).instance_id == "d4"
    busy = [peer(f"d{i}", free=100) for i in range(2)]
    busy[1].num_running = busy[1].num_light = 3  # interference decides before the cache
    cached.meta.decode_cached = {"d1": 64}
    assert PowerOfTwo(DispatchOptions(seed=0)).pick(cached, busy).instance_id == "d0"
    plain = [PowerOfTwo(DispatchOptions(seed=s)).pick(seq("new"), decodes).instance_id
             for s in range(20)]
    assert len(set(plain)) > 1  # without a cached prefix the draw stays random
