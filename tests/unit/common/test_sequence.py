from __future__ import annotations

import pytest

from common.block_pool import KVCacheManager
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.sequence import Sequence, SequenceMeta, SequenceStatus


def test_stop_conditions():
    params = SamplingParams(max_tokens=3, eos_token_ids=(2,), stop_token_ids=(9,))
    s = Sequence("a", [5, 6], params, max_model_len=100)
    s.append_token(4)
    assert not s.is_finished
    s.append_token(2)
    assert s.status == SequenceStatus.FINISHED_STOPPED and s.finish_reason == "stop"
    ignoring = Sequence("b", [5], SamplingParams(max_tokens=2, eos_token_ids=(2,),
                                                 ignore_eos=True), max_model_len=100)
    ignoring.append_token(2)
    assert not ignoring.is_finished
    ignoring.append_token(2)
    assert ignoring.finish_reason == "length"
    stop_token = Sequence("c", [5], params, max_model_len=100)
    stop_token.append_token(9)
    assert stop_token.finish_reason == "stop"


def test_context_limit_finishes_with_length():
    s = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=100), max_model_len=4)
    s.append_token(5)
    assert s.finish_reason == "length"


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0),
                                 dict(top_k=-2), dict(stop=("",))])
def test_invalid_sampling_params(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad).validate()


def test_block_ids_read_the_table_the_kv_manager_keeps():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(), max_model_len=100)
    assert s.block_ids == []  # held by no scheduler yet
    s.kv = kv
    kv.grow("a", 5)
    assert s.block_ids == kv.table("a") and len(s.block_ids) == 2
    kv.free("a")
    assert s.block_ids == []


def test_meta_deadline_zero_means_none():
    assert SequenceMeta(deadline=100.0).is_past_deadline(100.5)
    assert not SequenceMeta(deadline=100.0).is_past_deadline(99.0)
    assert not SequenceMeta().is_past_deadline(1e12)
