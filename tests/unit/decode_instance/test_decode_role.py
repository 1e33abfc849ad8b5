"""The decode role on a fake RoleContext: streaming, finish counts by prediction, deadlines."""

from __future__ import annotations

import time
from types import SimpleNamespace

from common.block_pool import KVCacheManager
from common.config import BatchConfig, DecodeConfig, EngineConfig, PredictionConfig, TransferConfig
from common.engine.role import RoleContext
from common.protocol import GenerateRequest, LengthPrediction
from common.sampling_params import SamplingParams
from common.sequence import Sequence, SequenceMeta
from decode_instance.role import DecodeRole

from unit.role_fixtures import FakeOutbox, run_turn

GATEWAY = "tcp://gateway"
HEAVY = LengthPrediction(2, 200, 300)  # over the default threshold of 128 tokens


def make_role(num_blocks=32, block_size=4, flip_drain="finish") -> DecodeRole:
    config = SimpleNamespace(
        engine=EngineConfig(batch=BatchConfig(max_num_seqs=4, max_num_batched_tokens=16)),
        decode=DecodeConfig(flip_drain=flip_drain), prediction=PredictionConfig(),
        transfer=TransferConfig())
    runner = SimpleNamespace(max_model_len=256)
    ctx = RoleContext("decode-0", config, runner, KVCacheManager(num_blocks, block_size),
                      SimpleNamespace(poll=lambda: []), FakeOutbox(), "tcp://me")
    return DecodeRole(ctx)


def received(role, seq_id, max_tokens=2, deadline=0.0, prediction=None):
    """A sequence as the receiver hands it over: prompt 4 tokens + first token, KV in place."""
    meta = SequenceMeta(GATEWAY, deadline, prediction=prediction, first_prediction=prediction)
    s = Sequence(seq_id, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens), 256, meta=meta)
    s.token_ids.append(100)
    s.num_computed_tokens = 4
    role.ctx.kv.grow(seq_id, 5)
    role.scheduler.add_prefilled(s)
    return s


def turn(role):
    return [(u.request_id, u.token_ids, u.finish_reason, u.error)
            for u in run_turn(role, GATEWAY)]


def test_tokens_stream_to_the_gateway_and_finishes_count_by_prediction():
    role = make_role()
    received(role, "heavy", prediction=HEAVY)
    received(role, "light")
    assert role.load()["num_heavy_decodes"] == 1 and role.live_seq_ids() == {"heavy", "light"}
    assert turn(role) == [("heavy", [9], "length", ""), ("light", [9], "length", "")]
    load = role.load()
    assert (load["num_finished_heavy"], load["num_finished_light"]) == (1, 1)
    assert role.is_drained and role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks


def test_a_sequence_past_its_deadline_is_dropped_with_an_error():
    role = make_role()
    received(role, "late", max_tokens=10, deadline=time.time() - 1)
    assert turn(role) == [("late", [], "error", "request deadline exceeded")]
    assert not role.has_work and role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks


def test_a_prompt_sent_to_a_decode_instance_goes_back_recoverable():
    role = make_role()
    role.handle(GenerateRequest("p", [1, 2], SamplingParams(), GATEWAY, time.time()))
    (update,) = role.ctx.pending_tokens.pop(GATEWAY)
    assert update.error == "not a prefill instance" and update.recoverable


def test_a_flip_drain_finishes_the_held_decodes_by_default():
    role = make_role()
    received(role, "a", max_tokens=3)
    role.begin_drain()
    assert not role.is_drained and role.num_migrated == 0
    assert turn(role) == [("a", [9], None, "")]  # decoding goes on during the drain
    assert turn(role) == [("a", [9], "length", "")] and role.is_drained


def test_a_migrating_flip_drain_hands_every_held_sequence_back_recoverable():
    role = make_role(flip_drain="migrate")
    received(role, "a", max_tokens=8)
    received(role, "b", max_tokens=8)
    assert turn(role) == [("a", [9], None, ""), ("b", [9], None, "")]
    role.begin_drain()
    updates = role.ctx.pending_tokens.pop(GATEWAY)
    assert [(u.request_id, u.recoverable, u.num_output_tokens) for u in updates] == [
        ("a", True, 2), ("b", True, 2)]  # each with its output so far: the gateway holds it
    assert role.is_drained and role.num_migrated == 2
    assert role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks  # nothing leaked
    # a sequence whose KV arrives after the drain began goes the same way at the next turn
    received(role, "late", max_tokens=8)
    assert turn(role) == [("late", [], "error",
                           "instance is flipping to prefill: run again elsewhere")]
    assert role.num_migrated == 3 and role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks
