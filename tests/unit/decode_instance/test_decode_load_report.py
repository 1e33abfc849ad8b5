"""The decode instance's load report counts offers in flight: waiting for admission and being
read, heavy or light, the blocks the waiting ones will take, and the last offer number received
from each prefill instance, all as of one moment."""

from __future__ import annotations

import time
from types import SimpleNamespace

from common.block_pool import KVCacheManager
from common.config import BatchConfig, DecodeConfig, EngineConfig, PredictionConfig, TransferConfig
from common.engine.role import RoleContext
from common.protocol import KVTransferDone, KVTransferOffer, LengthPrediction
from common.sampling_params import SamplingParams
from common.transfer import TransferResult, TransferStatus
from control_plane.cluster import decode_peer
from decode_instance.role import DecodeRole

from unit.role_fixtures import FakeOutbox

HEAVY = LengthPrediction(2, 200, 300)  # over the default threshold of 128 tokens


class FakeTransfer:
    def __init__(self) -> None:
        self.jobs, self.results = [], []

    def submit(self, job) -> None:
        self.jobs.append(job)

    def poll(self) -> list[TransferResult]:
        results, self.results = self.results, []
        return results

    def cancel(self, request_id) -> None:
        pass

    def forget(self, request_id) -> None:
        pass


def make_role(num_blocks=8, block_size=4) -> DecodeRole:
    config = SimpleNamespace(
        engine=EngineConfig(batch=BatchConfig(max_num_seqs=4, max_num_batched_tokens=16)),
        decode=DecodeConfig(), prediction=PredictionConfig(), transfer=TransferConfig())
    ctx = RoleContext("decode-0", config, SimpleNamespace(max_model_len=256),
                      KVCacheManager(num_blocks, block_size), FakeTransfer(), FakeOutbox(),
                      "tcp://me")
    return DecodeRole(ctx)


def offer(request_id, number, source="prefill-0", num_tokens=6, prediction=None):
    """A request-level offer: 5 prompt tokens + the first token; admission takes
    ceil((6 + 1) / 4) = 2 blocks."""
    return KVTransferOffer(request_id, list(range(num_tokens)), num_tokens - 1, SamplingParams(),
                           "tcp://gateway", source, f"tcp://{source}", "kv://p", [0, 1],
                           num_tokens - 1, time.time() + 60, prediction=prediction,
                           offer_number=number)


def incoming(role) -> tuple:
    load = role.load()
    return (load["num_waiting"], load["num_transferring"], load["num_running"],
            load["num_incoming_heavy"], load["num_incoming_light"], load["num_reserved_blocks"])


def test_offers_count_from_arrival_through_transfer_to_running():
    role = make_role()
    role.handle(offer("h", 7, prediction=HEAVY))
    role.handle(offer("l", 9))
    role.handle(offer("q", 3, source="prefill-1", num_tokens=14))  # 4 blocks
    # waiting, heavy/light, the blocks each will take, the last numbers per prefill instance
    assert incoming(role) == (3, 0, 0, 1, 2, 2 + 2 + 4)
    assert role.load()["offers_seen"] == {"prefill-0": 9, "prefill-1": 3}
    role.poll()  # 8 blocks: h and l are admitted (2 each); q (4) fits as well
    assert incoming(role) == (0, 3, 0, 1, 2, 0) and role.ctx.kv.num_free_blocks == 0
    role.ctx.transfer.results.append(TransferResult("h", TransferStatus.DONE))
    role.poll()  # h's KV arrived: it decodes now; the others are still being read
    assert incoming(role) == (0, 2, 1, 0, 2, 0)
    load = role.load()
    assert (load["num_heavy_decodes"], load["num_light_decodes"]) == (1, 0)


def test_a_waiting_offer_leaves_its_blocks_out_of_the_free_ones_a_dispatcher_sees():
    role = make_role(num_blocks=4)
    role.handle(offer("big", 1, num_tokens=14))  # 4 blocks: admitted
    role.poll()
    role.handle(offer("next", 2))  # no room: waits
    role.poll()
    load = role.load()
    report = SimpleNamespace(**load, instance_id="decode-0", inbox="", kv_endpoint="",
                             num_free_blocks=role.ctx.kv.num_free_blocks, num_total_blocks=4,
                             timestamp=5.0)
    peer = decode_peer(report)
    assert (peer.num_running, peer.num_light, peer.num_free_blocks) == (2, 2, 0)
    assert load["num_reserved_blocks"] == 2 and peer.offers_seen == {"prefill-0": 2}


def test_refused_and_aborted_offers_are_acknowledged_but_not_counted():
    role = make_role()
    role._abort("gone")
    role.handle(offer("gone", 4))  # the abort overtook it
    role.begin_drain()
    role.handle(offer("late", 5))  # draining: refused
    statuses = [m.status for _, m in role.ctx.outbox.sent if isinstance(m, KVTransferDone)]
    assert statuses == [TransferStatus.ABORTED, TransferStatus.REJECTED]
    assert incoming(role) == (0, 0, 0, 0, 0, 0)
    assert role.load()["offers_seen"] == {"prefill-0": 5}  # the sender may stop counting both
