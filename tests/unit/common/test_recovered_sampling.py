"""A recovered request (GenerateRequest.num_generated = k: a migrated or failed-over attempt run
again from prompt + generated tokens) samples its next token as the uninterrupted request
would have: seeded with token index k, its k tokens penalized as output (not prompt), and
min_tokens counting them. Checked on the chunk the prefill role hands the runner, no model."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from common.block_pool import KVCacheManager
from common.config import EngineConfig, PredictionConfig, PrefillConfig, TransferConfig
from common.engine import logits_process
from common.engine.kv_cache import KVLayout
from common.engine.role import RoleContext
from common.engine.sampler import RowParams, Sampler, token_seed
from common.plan import ModelOutput
from common.protocol import GenerateRequest, KVTransferOffer, PeerInfo
from common.sampling_params import SamplingParams
from prefill_instance.role import PrefillRole

from unit.role_fixtures import FakeOutbox

GATEWAY, EOS, VOCAB = "tcp://gateway", 2, 20
PROMPT = [10, 11, 12, 13, 14, 15]
GENERATED = [7, 7, 8]  # streamed before the attempt was handed back
K = len(GENERATED)
PARAMS = SamplingParams(max_tokens=10, temperature=0.8, seed=1234, repetition_penalty=1.25,
                        frequency_penalty=0.5, presence_penalty=0.25, min_tokens=K + 1,
                        eos_token_ids=(EOS,))


def prefill_role() -> PrefillRole:
    # chunk size 4: the 9 tokens take three chunks, only the last one samples
    config = SimpleNamespace(engine=EngineConfig(), transfer=TransferConfig(),
                             prefill=PrefillConfig(chunk_size=4, dispatch_policy="least_loaded"),
                             prediction=PredictionConfig())
    runner = SimpleNamespace(max_model_len=256, swap_space=None, device=torch.device("cpu"),
                             kv_layout=KVLayout(1, 32, 4, 1, 2, "float32"))
    ctx = RoleContext("prefill-0", config, runner, KVCacheManager(32, 4),
                      SimpleNamespace(endpoint="kv://prefill-0"), FakeOutbox(), "tcp://me")
    role = PrefillRole(ctx)
    role.handoffs.decodes = [PeerInfo("d0", "tcp://d0", "", num_free_blocks=30,
                                      num_total_blocks=32)]
    role.handle(GenerateRequest("r.1", PROMPT + GENERATED, PARAMS, GATEWAY, time.time(),
                                num_generated=K))
    return role


def sampling_chunk(role: PrefillRole):
    """Forwards (fake: they sample 9) until the chunk that samples; returns it, unforwarded."""
    for _ in range(5):
        plan = role.schedule()
        (chunk,) = plan.chunks
        if chunk.sampling is not None:
            return plan, chunk
        role.update_from_output(plan, ModelOutput({}))
    raise AssertionError("no chunk sampled")


def test_the_next_token_is_keyed_with_the_index_it_has_in_the_uninterrupted_output():
    _, chunk = sampling_chunk(prefill_role())
    # what ModelRunner.execute hands the sampler: each sample chunk's num_output_tokens
    assert chunk.num_output_tokens == K
    rows = RowParams.build([0], [chunk.sampling], [chunk.num_output_tokens],
                           torch.Generator().manual_seed(0))
    assert rows.keys.tolist() == [token_seed(PARAMS.seed, K)] != [token_seed(PARAMS.seed, 0)]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    # another sampler (another generator) drawing token K of the same request: the same token
    assert Sampler(torch.device("cpu"), seed=1)(logits, [PARAMS], [chunk.num_output_tokens]) \
        == Sampler(torch.device("cpu"), seed=2)(logits, [PARAMS], [K])


def test_penalties_and_min_tokens_see_the_generated_tokens_as_output():
    _, chunk = sampling_chunk(prefill_role())
    assert chunk.num_prompt_tokens == len(PROMPT)
    assert chunk.history[:len(PROMPT) + K] == PROMPT + GENERATED
    out = logits_process.process(torch.ones(1, VOCAB), [chunk])[0]
    repeated = 1 / 1.25  # a positive logit divided by the repetition penalty
    assert out[7].item() == pytest.approx(repeated - 0.5 * 2 - 0.25)  # output, twice
    assert out[8].item() == pytest.approx(repeated - 0.5 - 0.25)  # output, once
    assert out[10].item() == pytest.approx(repeated)  # prompt: repetition alone
    assert out[3].item() == 1.0
    assert out[EOS].item() == float("-inf")  # K tokens so far < min_tokens = K + 1


def test_the_hand_off_keeps_the_generated_tokens_as_output_for_the_decode_instance():
    role = prefill_role()
    plan, chunk = sampling_chunk(role)
    role.update_from_output(plan, ModelOutput({chunk.seq_id: 9}))
    (first,) = role.ctx.pending_tokens.pop(GATEWAY)
    assert first.token_ids == [9] and first.num_output_tokens == K + 1
    (offer,) = [m for _, m in role.ctx.outbox.sent if isinstance(m, KVTransferOffer)]
    # the receiver's sequence: token_ids[:num_prompt_tokens] as prompt, so the decode
    # instance's first token is index K + 1
    assert offer.token_ids == PROMPT + GENERATED + [9]
    assert offer.num_prompt_tokens == len(PROMPT)
