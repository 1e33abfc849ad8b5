"""The decode instance's receiver on a fake transfer: admission, reads, and what it counts."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from common.block_pool import KVCacheManager, iter_block_hashes
from common.config import TransferConfig
from common.protocol import KVChunkReady, KVTransferDone, KVTransferOffer
from common.sampling_params import SamplingParams
from common.transfer import TransferResult, TransferStatus
from decode_instance.receiver import Receiver

from unit.role_fixtures import FakeOutbox

BLOCK = 4


class FakeTransfer:
    """Records the jobs; the test says how each ends."""

    def __init__(self) -> None:
        self.jobs = []

    def submit(self, job) -> None:
        self.jobs.append(job)

    def cancel(self, request_id) -> None:
        pass

    def forget(self, request_id) -> None:
        pass


def make_receiver(num_blocks=32, prefix_caching=False):
    ctx = SimpleNamespace(kv=KVCacheManager(num_blocks, BLOCK, prefix_caching),
                          transfer=FakeTransfer(),
                          outbox=FakeOutbox(), config=SimpleNamespace(transfer=TransferConfig()),
                          runner=SimpleNamespace(max_model_len=256), counts=[])
    ctx.send = ctx.outbox.send
    ctx.count = lambda name, amount=1.0, **labels: ctx.counts.append((name, amount, labels))
    return Receiver(ctx)


def offer(request_id, num_prompt, num_output=0, cached=None, final=True):
    """A prompt of `num_prompt` tokens and `num_output` generated before (a recovered request),
    plus the token the prefill sampled when final."""
    tokens = list(range(1, num_prompt + num_output + 1)) + ([99] if final else [])
    done = num_prompt + num_output if cached is None else cached
    return KVTransferOffer(request_id, tokens, num_prompt, SamplingParams(max_tokens=8), "gw",
                           "prefill-0", "tcp://prefill", "tcp://prefill-kv",
                           list(range(100, 100 + -(-done // BLOCK))), done, 1e12, final=final)


def finish(receiver, job, status=TransferStatus.DONE):
    receiver.on_result(TransferResult(job.request_id, status, final=job.final))


def read_blocks(receiver):
    return [(len(job.remote_block_ids), job.num_tokens) for job in receiver.ctx.transfer.jobs]


def test_a_request_level_offer_is_one_read_of_its_prompt_blocks():
    receiver = make_receiver()
    receiver.offer(offer("a", 10))
    receiver.admit()
    assert read_blocks(receiver) == [(3, 10)] and receiver.num_active == 1
    assert receiver.blocks_read == 0  # nothing has come over yet
    finish(receiver, receiver.ctx.transfer.jobs[0])
    (seq,) = receiver.take_ready()
    assert seq.num_computed_tokens == 10 and seq.token_ids[-1] == 99
    assert receiver.blocks_read == 3 and receiver.is_idle
    assert isinstance(receiver.ctx.outbox.sent[-1][1], KVTransferDone)


def test_a_recovered_request_counts_the_blocks_of_its_output_so_far():
    receiver = make_receiver()
    receiver.offer(offer("r", 10, num_output=5))  # the prefill recomputed 15 tokens
    receiver.admit()
    assert read_blocks(receiver) == [(4, 15)]
    finish(receiver, receiver.ctx.transfer.jobs[0])
    assert receiver.blocks_read == 4  # not the prompt's 3
    assert ("transfer_blocks", 4, {"kind": "read"}) in receiver.ctx.counts


def test_a_chunk_level_hand_off_counts_a_block_read_twice_once():
    receiver = make_receiver()
    receiver.offer(offer("c", 10, cached=6, final=False))  # first chunk: 6 tokens, 2 blocks
    receiver.admit()
    receiver.chunk(KVChunkReady("c", list(range(100, 103)), 10, True,
                                list(range(1, 11)) + [99], lease_expires=1e12))
    assert read_blocks(receiver) == [(2, 6), (2, 4)]  # block 1 was partly filled: read again
    for job in receiver.ctx.transfer.jobs:
        finish(receiver, job)
    assert receiver.blocks_read == 3 and len(receiver.take_ready()) == 1


def test_a_failed_read_counts_nothing_and_frees_the_blocks():
    receiver = make_receiver()
    receiver.offer(offer("f", 10))
    receiver.admit()
    assert receiver.ctx.kv.num_free_blocks < 32
    finish(receiver, receiver.ctx.transfer.jobs[0], TransferStatus.FAILED)
    assert receiver.blocks_read == 0 and receiver.ctx.kv.num_free_blocks == 32
    ((failed, error),) = receiver.take_failed()
    assert failed.request_id == "f" and error == "KV transfer failed: transfer failed"
    done = receiver.ctx.outbox.sent[-1][1]
    assert isinstance(done, KVTransferDone) and done.status is TransferStatus.FAILED


def test_the_prefill_instances_block_hashes_are_taken_not_computed_again():
    receiver = make_receiver(prefix_caching=True)
    sent = offer("h", 10)
    hashes = list(iter_block_hashes(sent.token_ids, BLOCK, 10))
    receiver.offer(msgspec.structs.replace(sent, block_hashes=hashes))
    receiver.admit()
    kv = receiver.ctx.kv
    kv.cache_computed("h", [0] * 11, 10)  # other tokens: only the sender's hashes can match
    assert kv.block_hashes("h") == hashes and len(hashes) == 2
