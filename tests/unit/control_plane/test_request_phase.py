"""The phase the gateway's request table shows while a request runs: QUEUED until its first
token, PREFILLED at it, DECODING while a decode instance generates (whichever transfer
granularity handed it over), FINISHED at the end."""

from __future__ import annotations

import time

from common.config import GatewayConfig
from common.detokenizer import TextStream
from common.protocol import TokenUpdate
from common.sampling_params import SamplingParams
from common.store import InProcessStore
from control_plane.gateway import Gateway, RequestHandle
from control_plane.request_table import Phase, RequestRecord


class LetterTokenizer:
    """Token i is the letter chr(97 + i): enough for the gateway's detokenizer."""

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


class Request:
    """One request at a gateway that was never started: updates go straight to `_absorb`."""

    def __init__(self) -> None:
        self.gateway = Gateway(GatewayConfig(), LetterTokenizer(), "m", store=InProcessStore())
        self.handle = RequestHandle("r", [1, 2, 3], SamplingParams(max_tokens=8),
                                    time.monotonic() + 60, "p0", attempt_id="r.0")
        self.gateway.table.create(RequestRecord("r", time.time(), 3, prefill_instance="p0"))
        self.text = TextStream(self.gateway.tokenizer, ())

    def absorb(self, token_ids=(), finish=None, next_instance="", instance="p0") -> Phase:
        self.gateway._absorb(self.handle, TokenUpdate(
            "r.0", list(token_ids), finish, instance_id=instance,
            next_instance=next_instance), self.text)
        return self.record().phase

    def record(self) -> RequestRecord:
        return self.gateway.table.get("r")


def test_request_level_transfer_reads_decoding_for_the_whole_decode():
    request = Request()
    # The prefill instance's first token comes with the hand-off to the decode instance.
    assert request.absorb([4], next_instance="d0") is Phase.DECODING
    assert request.record().decode_instance == "d0"
    assert request.absorb([5], instance="d0") is Phase.DECODING
    assert request.absorb([6], instance="d0") is Phase.DECODING
    assert request.absorb([7], finish="length", instance="d0") is Phase.FINISHED
    stamps = request.record().timestamps
    assert stamps["queued"] <= stamps["prefilled"] <= stamps["decoding"] <= stamps["finished"]


def test_chunk_level_transfer_reads_decoding_only_once_the_prompt_is_done():
    request = Request()
    # The hand-off comes after the first chunk, while the prefill goes on.
    assert request.absorb(next_instance="d0") is Phase.QUEUED
    assert request.absorb([4]) is Phase.DECODING
    assert request.record().decode_instance == "d0"
    assert request.absorb([5], instance="d0") is Phase.DECODING


def test_a_request_handed_on_records_its_new_decode_instance():
    request = Request()
    request.absorb([4], next_instance="d0")
    assert request.absorb(next_instance="d1") is Phase.DECODING  # d0 refused the offer
    assert request.record().decode_instance == "d1"


def test_a_coupled_instance_never_hands_over():
    request = Request()
    assert request.absorb([4], instance="c0") is Phase.PREFILLED
    assert request.absorb([5], instance="c0") is Phase.PREFILLED
    assert request.absorb([6], finish="stop", instance="c0") is Phase.FINISHED
