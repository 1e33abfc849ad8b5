"""The prefill role on a fake RoleContext: hand-off, a rejected offer offered again elsewhere."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from common.block_pool import KVCacheManager, iter_block_hashes
from common.config import (
    EngineConfig,
    ModelConfig,
    PredictionConfig,
    PrefillConfig,
    TransferConfig,
)
from common.engine.kv_cache import KVLayout
from common.engine.role import RoleContext
from common.plan import ModelOutput
from common.profile_record import write_record
from common.protocol import GenerateRequest, KVTransferDone, KVTransferOffer, PeerInfo
from common.sampling_params import SamplingParams
from common.transfer import TransferStatus
from prefill_instance.role import DEFAULT_CHUNK_SIZE, PrefillRole

from unit.role_fixtures import FakeOutbox

GATEWAY = "tcp://gateway"


def make_role(num_blocks=32, block_size=4, prefix_caching=False, chunk_size=8, engine=None,
              **served) -> PrefillRole:
    config = SimpleNamespace(engine=engine or EngineConfig(), transfer=TransferConfig(),
                             prefill=PrefillConfig(chunk_size=chunk_size,
                                                   dispatch_policy="least_loaded"),
                             prediction=PredictionConfig())
    runner = SimpleNamespace(max_model_len=256, swap_space=None, device=torch.device("cpu"),
                             kv_layout=KVLayout(1, num_blocks, block_size, 1, 2, "float32"),
                             **served)
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    ctx = RoleContext("prefill-0", config, runner, kv,
                      SimpleNamespace(endpoint="kv://prefill-0"), FakeOutbox(), "tcp://me")
    return PrefillRole(ctx)


def decode(name, free=20) -> PeerInfo:
    return PeerInfo(name, f"tcp://{name}", "", num_free_blocks=free, num_total_blocks=32)


def prefill(role, request_id="r", num_prompt=5):
    role.handle(GenerateRequest(request_id, list(range(1, num_prompt + 1)),
                                SamplingParams(max_tokens=4), GATEWAY, time.time()))
    plan = role.schedule()
    role.update_from_output(plan, ModelOutput(
        {c.seq_id: 9 for c in plan.chunks if c.sampling is not None}))


def offers(role) -> list[str]:
    return [address for address, message in role.ctx.outbox.sent
            if isinstance(message, KVTransferOffer)]


def test_a_rejected_offer_goes_to_another_decode_and_the_gateway_hears_of_it():
    role = make_role()
    role.handoffs.decodes = [decode("d0", free=30), decode("d1", free=10)]
    prefill(role)
    first, = role.ctx.pending_tokens.pop(GATEWAY)
    assert first.token_ids == [9] and first.next_instance == "d0" and offers(role) == ["tcp://d0"]
    role.handle(KVTransferDone("r", TransferStatus.REJECTED, "draining"))
    role.poll()  # offered again, skipping the instance that refused
    assert offers(role) == ["tcp://d0", "tcp://d1"]
    moved, = role.ctx.pending_tokens.pop(GATEWAY)
    assert moved.next_instance == "d1" and not moved.token_ids
    role.handle(KVTransferDone("r", TransferStatus.DONE, ""))
    assert role.is_drained and role.ctx.kv.num_free_blocks == 32


def test_an_offer_carries_the_prompts_block_hashes_for_the_decode_instance():
    role = make_role(prefix_caching=True)
    role.handoffs.decodes = [decode("d0", free=30)]
    prefill(role, num_prompt=8)  # one chunk, two full blocks of four
    offer, = [m for _, m in role.ctx.outbox.sent if isinstance(m, KVTransferOffer)]
    assert offer.block_hashes == list(iter_block_hashes(list(range(1, 9)), 4, 8))
    assert len(offer.block_hashes) == 2


def test_the_chunk_size_comes_from_the_record_measured_for_the_runners_forwards(tmp_path):
    record = {"model": "m", "dtype": "float32"}
    write_record(tmp_path, {**record, "threads": 1, "recommended_chunk_size": 64})
    write_record(tmp_path, {**record, "threads": 2, "recommended_chunk_size": 384})  # the last
    engine = EngineConfig(model=ModelConfig(cache_dir=str(tmp_path)))

    def chunk_size(threads):
        return make_role(chunk_size=0, engine=engine, resolved=SimpleNamespace(name="m"),
                         dtype_name="float32", num_threads=threads).chunk_size
    assert chunk_size(1) == 64  # not the 2-thread profile that ran last
    assert chunk_size(2) == 384
    assert chunk_size(4) == DEFAULT_CHUNK_SIZE  # nothing measured for 4 threads
    assert make_role(chunk_size=96, engine=engine).chunk_size == 96  # configured wins
