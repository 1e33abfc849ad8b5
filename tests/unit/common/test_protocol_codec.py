"""Round trips of every wire message through the one codec, and the codec's error contract."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from common import protocol
from common.protocol import (
    AbortRequest,
    ClusterView,
    CodecError,
    FlipCommand,
    FlipReport,
    GenerateRequest,
    InstanceStats,
    KVCacheEvents,
    KVChunkReady,
    KVTransferDone,
    KVTransferOffer,
    Message,
    PeerInfo,
    Shutdown,
    TokenBatch,
    TokenUpdate,
    decode,
    encode,
)
from common.sampling_params import SamplingParams
from common.transfer import TransferStatus

# Non-default values everywhere, so a field dropped or mistyped by the codec shows up.
SAMPLING = SamplingParams(max_tokens=33, temperature=0.5, top_p=0.9, top_k=40, seed=1234,
                          stop=("\n\n", "END"), stop_token_ids=(7, 8), eos_token_ids=(2,),
                          ignore_eos=True)

MESSAGES = [
    GenerateRequest("req-1", [1, 2, 3, 50000], SAMPLING, "tcp://127.0.0.1:5555",
                    arrival_time=1700000000.25, deadline=1700000600.5),
    GenerateRequest("req-defaults", [9], SamplingParams(), "tcp://gw", arrival_time=1.0),
    AbortRequest("req-1", reason="client disconnected"),
    AbortRequest("req-2"),
    ClusterView([PeerInfo("decode-0", "tcp://10.0.0.1:7000", "tcp://10.0.0.1:7001",
                          num_free_blocks=100, num_total_blocks=512, num_running=3,
                          num_waiting=1),
                 PeerInfo("decode-1", "tcp://10.0.0.2:7000", "shm://decode-1")],
                timestamp=1700000001.5),
    ClusterView([]),
    KVTransferOffer("req-1", [1, 2, 3, 42], num_prompt_tokens=3, sampling=SAMPLING,
                    reply_to="tcp://gw", source_instance="prefill-0",
                    source_inbox="tcp://10.0.0.3:7000", kv_endpoint="tcp://10.0.0.3:7001",
                    block_ids=[5, 9, 2], num_cached_tokens=3, lease_expires=1700000030.0,
                    arrival_time=1700000000.25, deadline=1700000600.5),
    KVTransferDone("req-1"),
    KVTransferDone("req-1", TransferStatus.FAILED, "read timed out"),
    InstanceStats("prefill-0", "prefill", "tcp://a:1", "tcp://a:2", "some/model", 4096,
                  num_total_blocks=512, num_free_blocks=300, num_waiting=4, num_running=2,
                  num_transferring=1, num_queued_tokens=777, busy_seconds=12.5,
                  timestamp=1700000002.0, pid=4242),
    TokenBatch([TokenUpdate("req-1", [42], None, num_prompt_tokens=3, num_output_tokens=1,
                            instance_id="prefill-0", next_instance="decode-1"),
                TokenUpdate("req-2", [], "error", error="out of memory"),
                TokenUpdate("req-3", [5, 6, 7], "stop", num_output_tokens=9)]),
    TokenBatch([]),
    Shutdown(),
    FlipCommand("f1", "decode"),
    KVChunkReady("r1", [4, 5, 6], 40, True, [1, 2, 3]),
    FlipReport("f1", "prefill-0", "prefill", "decode", 0.25, 0.0012, 1700000000.5),
    ClusterView([], 2.0, dead=["decode-3"]),
    GenerateRequest("r9", [1, 2, 3, 4], SamplingParams(max_tokens=9), "tcp://g:1", 1.0,
                    num_generated=2),
    GenerateRequest("r10", [1] * 40, SamplingParams(), "tcp://g:1", 1.0, local_prefill=True,
                    decode_cached_tokens={"decode-0": 32}),
    KVCacheEvents("decode-0", 16, [2**64 - 1, 7], [3]),
    KVCacheEvents("decode-1", 16, [11, 12], snapshot=True),
]


def message_classes() -> set[type]:
    """Every Message subclass defined in common.protocol (found by introspection)."""
    return {obj for _, obj in inspect.getmembers(protocol, inspect.isclass)
            if issubclass(obj, Message) and obj is not Message
            and obj.__module__ == protocol.__name__}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    data = encode(message)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(message)
    assert back == message
    assert encode(back) == data


def test_transfer_status_travels_as_an_enum():
    back = decode(encode(KVTransferDone.rejected("req-1", "draining")))
    assert back.status is TransferStatus.REJECTED and not back.ok
    assert decode(encode(KVTransferDone("req-1"))).ok


def test_round_trip_keeps_nested_types():
    back = decode(encode(MESSAGES[0]))
    assert isinstance(back.sampling, SamplingParams)
    assert back.sampling.stop == ("\n\n", "END") and isinstance(back.sampling.stop, tuple)
    view = decode(encode(MESSAGES[4]))
    assert all(type(p) is PeerInfo for p in view.decodes)
    assert view.decodes[1].num_total_blocks == 0
    batch = decode(encode(MESSAGES[10]))
    assert all(type(u) is TokenUpdate for u in batch.items)
    assert batch.items[1].token_ids == [] and batch.items[1].finish_reason == "error"


def test_every_message_class_is_round_tripped():
    classes = message_classes()
    assert len(classes) >= 8
    covered = {type(m) for m in MESSAGES}
    assert classes - covered == set(), "a message class has no round-trip case"
    # ... and the decoder knows every one of them (else decode() could never produce it).
    decodable = set(protocol.AnyMessage.__args__)
    assert classes == decodable


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all \xff\x00",
                                  encode(MESSAGES[0])[:10], encode(Shutdown()) + b"\x00"],
                         ids=["empty", "reserved-byte", "garbage", "truncated", "trailing"])
def test_decode_of_garbage_raises_codec_error(data):
    with pytest.raises(CodecError):
        decode(data)


@pytest.mark.parametrize("field", [b"abc", b"AbortRequest"], ids=["value", "tag"])
def test_decode_of_invalid_utf8_string_raises_codec_error(field):
    data = encode(AbortRequest("abc"))
    corrupt = data.replace(field, b"\xff" * len(field))
    assert corrupt != data
    with pytest.raises(CodecError):
        decode(corrupt)


def test_decode_of_unknown_tag_raises_codec_error():
    data = msgspec.msgpack.encode({"type": "LaunchMissiles", "request_id": "x"})
    with pytest.raises(CodecError, match="LaunchMissiles|tag|type"):
        decode(data)


@pytest.mark.parametrize("payload", [
    42,  # not a map at all
    {"request_id": "x"},  # no tag
    {"type": "AbortRequest"},  # a known tag missing a required field
    {"type": "AbortRequest", "request_id": 5},  # a field of the wrong type
    {"type": "PeerInfo", "instance_id": "d", "inbox": "i", "kv_endpoint": "k"},  # not a message
], ids=["int", "untagged", "missing-field", "wrong-type", "peerinfo"])
def test_decode_of_valid_msgpack_that_is_not_a_message_raises_codec_error(payload):
    with pytest.raises(CodecError):
        decode(msgspec.msgpack.encode(payload))


def test_codec_error_is_a_value_error():
    assert issubclass(CodecError, ValueError)
