"""Guided decoding (common.engine.guided) on a 16-token vocabulary: the compile cache, the
per-step mask (constrained rows only, forced EOS at the grammar's end, vocabulary padding),
compile failures, matchers through preemption by recompute, and the roles holding a sequence
until its grammar is ready (then its matcher takes the output the sequence already has)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from common.block_pool import KVCacheManager
from common.config import BatchConfig, DecodeConfig, EngineConfig, PredictionConfig, TransferConfig
from common.engine import guided
from common.engine.role import RoleContext
from common.errors import InvalidRequestError
from common.plan import ModelOutput, ScheduledChunk
from common.protocol import AbortRequest, GenerateRequest
from common.sampling_params import GuidedSpec, SamplingParams
from common.sequence import Sequence, SequenceMeta
from coupled_instance.role import CoupledRole
from decode_instance.role import DecodeRole
from decode_instance.scheduler import DecodeScheduler

from unit.role_fixtures import FakeOutbox

VOCAB = ["<eos>", "a", "b", "ab", "y", "e", "s", "yes", "no", "{", "}", '"', ":", " ", "1", ","]
EOS = 0
TOKEN = {text: i for i, text in enumerate(VOCAB)}
GATEWAY = "tcp://gateway"
YES_NO = GuidedSpec("choice", '["yes", "no"]')
AB = GuidedSpec("regex", "(ab)+")


def tiny_info(vocab_size: int = len(VOCAB)) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[EOS])


@pytest.fixture
def compiler():
    compiler = guided.GrammarCompiler(tiny_info)
    yield compiler
    compiler.close()


def guide_for(compiler, spec: GuidedSpec) -> guided.Guide:
    return compiler.submit(spec).result(timeout=30).matcher(SamplingParams(eos_token_ids=(EOS,)))


def chunk(seq_id: str, guide=None, logprobs=None) -> ScheduledChunk:
    return ScheduledChunk(seq_id, [1], 0, [0], SamplingParams(logprobs=logprobs), guide=guide)


def allowed(row: torch.Tensor) -> set[int]:
    return {i for i, value in enumerate(row.tolist()) if value != float("-inf")}


# -- compiling -------------------------------------------------------------------------------------
def test_each_distinct_spec_compiles_once_in_a_background_thread(compiler):
    threads = []
    compiler._load_info = lambda: threads.append(threading.current_thread().name) or tiny_info()
    first = compiler.submit(YES_NO)
    assert compiler.submit(GuidedSpec("choice", '["yes", "no"]')) is first  # equal spec: a hit
    compiler.submit(AB).result(timeout=30)
    first.result(timeout=30)
    assert compiler.num_compiles == 2
    assert threads and threads[0].startswith("grammar")  # not the caller's thread


def test_the_cache_is_a_bounded_lru():
    compiler = guided.GrammarCompiler(tiny_info, cache_size=2)
    specs = [GuidedSpec("regex", r) for r in ("a", "b", "ab")]
    for spec in specs:
        compiler.submit(spec).result(timeout=30)
    compiler.submit(specs[2])  # most recent: still there
    assert compiler.num_compiles == 3
    compiler.submit(specs[0]).result(timeout=30)  # evicted first: compiled again
    assert compiler.num_compiles == 4
    compiler.close()


@pytest.mark.parametrize("spec, reason", [
    (GuidedSpec("regex", "(ab"), "parenthesis is not closed"),
    (GuidedSpec("json", "{not json"), "Failed to parse JSON"),
    (GuidedSpec("choice", '"yes"'), "non-empty JSON list"),
    (GuidedSpec("grammar", "root ::= "), "EBNF parser error"),
])
def test_a_spec_that_does_not_compile_fails_with_its_reason_and_stays_cached(compiler, spec,
                                                                              reason):
    future = compiler.submit(spec)
    error = future.exception(timeout=30)
    assert isinstance(error, InvalidRequestError) and reason in str(error)
    assert not str(error).startswith("[") and "\n" not in str(error)  # no engine source line
    assert compiler.submit(spec) is future and compiler.num_compiles == 1


def test_a_tokenizer_that_fails_to_load_is_not_a_cached_failure():
    attempts = []

    def load():
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("tokenizer.json missing")
        return tiny_info()

    compiler = guided.GrammarCompiler(load)
    assert isinstance(compiler.submit(AB).exception(timeout=30), OSError)
    assert compiler.submit(AB).result(timeout=30) is not None  # tried again
    compiler.close()


# -- the per-step mask ---------------------------------------------------------------------------
def test_no_guided_row_leaves_the_logits_as_they_are():
    logits = torch.randn(2, len(VOCAB))
    chunks = [chunk("a"), chunk("b")]
    assert guided.constrain(logits, chunks, logits) is logits


def test_only_constrained_rows_are_masked(compiler):
    logits = torch.randn(3, len(VOCAB))
    raw = logits.clone()
    chunks = [chunk("a", guide_for(compiler, AB)), chunk("free"),
              chunk("c", guide_for(compiler, YES_NO))]
    out = guided.constrain(logits, chunks, raw)
    assert out is logits  # in place: nobody reads these logits raw
    assert allowed(out[0]) == {TOKEN["a"], TOKEN["ab"]}
    assert torch.equal(out[1], raw[1])
    assert allowed(out[2]) == {TOKEN["y"], TOKEN["yes"], TOKEN["no"]}
    kept = out[0] != float("-inf")
    assert torch.equal(out[0][kept], raw[0][kept])  # allowed logits keep their values


def test_raw_logits_stay_raw_when_log_probabilities_or_logits_are_returned(compiler):
    for keep_raw, logprobs in ((True, None), (False, 2)):
        logits = torch.randn(1, len(VOCAB))
        raw = logits.clone()
        out = guided.constrain(logits, [chunk("a", guide_for(compiler, AB), logprobs)], logits,
                               keep_raw)
        assert out is not logits and torch.equal(logits, raw)
        assert allowed(out[0]) == {TOKEN["a"], TOKEN["ab"]}


def test_the_cpu_mask_matches_the_grammar_engines_kernel(compiler):
    guides = [guide_for(compiler, AB), guide_for(compiler, YES_NO)]
    guides[1].accept(TOKEN["y"])
    bitmask = xgr.allocate_token_bitmask(3, len(VOCAB))
    for row, guide in zip((0, 2), guides):
        guide.fill(bitmask, row)
    logits = torch.randn(3, len(VOCAB))
    expected = logits.clone()
    guided.apply_bitmask(logits, bitmask, [0, 2], len(VOCAB))
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 2], backend="cpu")
    assert torch.equal(logits, expected)


def test_a_complete_grammar_allows_only_eos_and_greedy_sampling_takes_it(compiler):
    guide = guide_for(compiler, YES_NO)
    assert guide.accept(TOKEN["yes"])
    for _ in range(2):  # complete; then terminated by its EOS: still EOS only
        logits = torch.randn(1, len(VOCAB))
        guided.constrain(logits, [chunk("a", guide)], None)
        assert allowed(logits[0]) == {EOS}
        assert int(logits.argmax()) == EOS
        guided.advance([chunk("a", guide)], [EOS])
    assert guide.matcher.is_terminated() and not guide.error


def test_a_rejected_token_ends_the_grammar_with_eos_only(compiler):
    guide = guide_for(compiler, AB)
    guided.advance([chunk("a", guide)], [TOKEN["no"]])  # e.g. sampled from an all -inf row
    assert guide.error and guide.is_ended
    logits = torch.randn(1, len(VOCAB))
    guided.constrain(logits, [chunk("a", guide)], None)
    assert allowed(logits[0]) == {EOS}


def test_vocabulary_padding_columns_are_masked_in_constrained_rows_only(compiler):
    width = len(VOCAB) + 40  # the model's logits are wider than the tokenizer
    logits = torch.zeros(2, width)
    guided.constrain(logits, [chunk("a", guide_for(compiler, AB)), chunk("free")], None)
    assert allowed(logits[0]) == {TOKEN["a"], TOKEN["ab"]}
    assert allowed(logits[1]) == set(range(width))


def test_the_engine_kernel_path_masks_the_same_rows_and_padding(compiler):
    """Logits the numpy path does not take (CUDA, or bfloat16 as here) go through xgrammar's
    kernel with row indices; the padding columns past its vocabulary are masked as well."""
    width = len(VOCAB) + 40
    logits = torch.zeros(2, width, dtype=torch.bfloat16)
    guided.constrain(logits, [chunk("free"), chunk("b", guide_for(compiler, AB))], None)
    assert allowed(logits[0].float()) == set(range(width))
    assert allowed(logits[1].float()) == {TOKEN["a"], TOKEN["ab"]}


def test_a_tokenizer_info_padded_to_the_logits_never_allows_padding():
    compiler = guided.GrammarCompiler(lambda: tiny_info(len(VOCAB) + 40))
    guide = guide_for(compiler, GuidedSpec("json_object"))
    logits = torch.zeros(1, len(VOCAB) + 40)
    guided.constrain(logits, [chunk("a", guide)], None)
    assert allowed(logits[0]) == {TOKEN["{"]}
    compiler.close()


def test_matchers_follow_the_sampled_tokens(compiler):
    guide = guide_for(compiler, AB)
    for token in (TOKEN["a"], TOKEN["b"], TOKEN["ab"]):
        guided.advance([chunk("a", guide)], [token])
    logits = torch.zeros(1, len(VOCAB))
    guided.constrain(logits, [chunk("a", guide)], None)
    assert allowed(logits[0]) == {TOKEN["a"], TOKEN["ab"], EOS}  # (ab)+ may stop or go on


# -- scheduling ------------------------------------------------------------------------------------
def lowest_allowed(chunks) -> list[int]:
    """The fake forward's sampling: per row, the lowest token id its grammar allows, EOS last,
    through guided.constrain and advance."""
    if not chunks:
        return []
    logits = -torch.arange(len(VOCAB), dtype=torch.float32).repeat(len(chunks), 1)
    logits[:, EOS] = -1e6
    tokens = guided.constrain(logits, chunks, None).argmax(dim=-1).tolist()
    guided.advance(chunks, tokens)
    return tokens


def test_preemption_by_recompute_keeps_each_matcher_in_step_with_its_output(compiler):
    """A pool of 4 blocks for two sequences of 8 tokens: the newer one is preempted, dropped
    and recomputed over prompt + output. Its output tokens are not sampled again, so its
    matcher (which took them) still matches: every output follows the grammar."""
    sched = DecodeScheduler(BatchConfig(max_num_seqs=8, max_num_batched_tokens=8),
                            KVCacheManager(4, 4))
    sampling = SamplingParams(max_tokens=6, eos_token_ids=(EOS,), guided=AB)
    seqs = []
    for seq_id in ("old", "new"):  # as received: prompt 1..7, then the prefill's "a"
        seq = Sequence(seq_id, list(range(1, 8)), sampling, 1000)
        seq.token_ids.append(TOKEN["a"])
        seq.num_computed_tokens = 7
        seq.guide = guide_for(compiler, AB)
        assert seq.guide.accept_all(seq.output_token_ids)
        sched.kv.grow(seq_id, 8)
        sched.add_prefilled(seq)
        seqs.append(seq)
    while sched.has_work:
        plan = sched.schedule()
        chunks = [c for c in plan.chunks if c.sampling is not None]
        tokens = lowest_allowed(chunks)
        sched.update_from_output(plan, ModelOutput(dict(zip([c.seq_id for c in chunks],
                                                            tokens))))
    assert sched.num_preemptions >= 1
    for seq in seqs:
        assert seq.output_token_ids == [TOKEN[c] for c in "ababab"] and not seq.guide.error


# -- the roles -------------------------------------------------------------------------------------
def forward(role) -> list:
    """One loop turn with the fake forward of `lowest_allowed`; returns the updates."""
    role.admit_compiled()
    role.poll()
    plan = role.schedule()
    chunks = [c for c in plan.chunks if c.sampling is not None]
    if chunks:
        tokens = lowest_allowed(chunks)
        role.update_from_output(plan, ModelOutput(
            {c.seq_id: t for c, t in zip(chunks, tokens)}))
    return [(u.request_id, u.token_ids, u.finish_reason, u.error)
            for u in role.ctx.pending_tokens.pop(GATEWAY, [])]


def coupled_role(compiler) -> CoupledRole:
    config = SimpleNamespace(engine=EngineConfig(batch=BatchConfig(max_num_seqs=4,
                                                                   max_num_batched_tokens=16)),
                             coupled_policy="vllm", coupled_swap_blocks=None,
                             coupled_swap_bandwidth=None, coupled_options=())
    ctx = RoleContext("coupled-0", config, SimpleNamespace(max_model_len=256, swap_space=None),
                      KVCacheManager(32, 4), None, FakeOutbox(), "tcp://me", grammar=compiler)
    return CoupledRole(ctx)


def guided_request(request_id, spec, prompt=(1, 2, 3), num_generated=0, max_tokens=6):
    return GenerateRequest(request_id, list(prompt),
                           SamplingParams(max_tokens=max_tokens, eos_token_ids=(EOS,),
                                          guided=spec),
                           GATEWAY, time.time(), num_generated=num_generated)


def wait_compiled(role):
    for _, _, future in list(role.compiling.values()):
        future.exception(timeout=30)


def test_a_sequence_is_held_until_its_grammar_compiled_then_follows_it():
    ready = threading.Event()
    compiler = guided.GrammarCompiler(lambda: ready.wait(30) and tiny_info())
    role = coupled_role(compiler)
    role.handle(guided_request("g", YES_NO))
    assert forward(role) == [] and role.schedule().is_empty  # compiling: not scheduled
    assert role.live_seq_ids() == {"g"} and not role.is_drained
    ready.set()
    wait_compiled(role)
    tokens = [forward(role) for _ in range(4)]
    assert [t for ((_, (t,), _, _),) in tokens] == [TOKEN[c] for c in "yes"] + [EOS]
    assert tokens[-1][0][2] == "stop"  # the grammar ended: EOS forced (lowest priority here)
    assert role.is_drained and role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks
    compiler.close()


def test_a_recovered_request_resumes_its_grammar_after_the_generated_tokens(compiler):
    role = coupled_role(compiler)
    # prompt 1, 2, 3 then "a" and "b" generated before the instance it ran on failed
    role.handle(guided_request("r", AB, prompt=(1, 2, 3, TOKEN["a"], TOKEN["b"]),
                               num_generated=2))
    wait_compiled(role)
    assert forward(role) == [("r", [TOKEN["a"]], None, "")]  # "a" (lowest allowed), not "b"


def test_a_spec_that_does_not_compile_fails_the_request_and_leaks_nothing(compiler):
    role = coupled_role(compiler)
    role.handle(guided_request("bad", GuidedSpec("regex", "(ab")))
    wait_compiled(role)
    ((request_id, tokens, finish, error),) = forward(role)
    assert (request_id, tokens, finish) == ("bad", [], "error")
    assert error.startswith("guided decoding: the regex spec does not compile: ")
    assert not role.compiling and role.is_drained and role.live_seq_ids() == set()


def test_an_output_that_does_not_match_the_grammar_fails_the_request(compiler):
    role = coupled_role(compiler)
    role.handle(guided_request("r", AB, prompt=(1, 2, TOKEN["no"]), num_generated=1))
    wait_compiled(role)
    assert forward(role)[0][3] == ("guided decoding: the request's generated tokens do not "
                                   "match its grammar")
    assert role.is_drained


def decode_role(compiler) -> DecodeRole:
    config = SimpleNamespace(
        engine=EngineConfig(batch=BatchConfig(max_num_seqs=4, max_num_batched_tokens=16)),
        decode=DecodeConfig(), prediction=PredictionConfig(), transfer=TransferConfig())
    ctx = RoleContext("decode-0", config, SimpleNamespace(max_model_len=256),
                      KVCacheManager(32, 4), SimpleNamespace(poll=list), FakeOutbox(),
                      "tcp://me", grammar=compiler)
    return DecodeRole(ctx)


def transferred(role, seq_id, spec, first_token) -> Sequence:
    """What the receiver hands over: prompt 1..4 then the prefill's first token, KV read."""
    sampling = SamplingParams(max_tokens=6, eos_token_ids=(EOS,), guided=spec)
    seq = Sequence(seq_id, [1, 2, 3, 4], sampling, 256, meta=SequenceMeta(GATEWAY))
    seq.token_ids.append(first_token)
    seq.num_computed_tokens = 4
    role.ctx.kv.grow(seq_id, 5)
    role.receiver.ready.append(seq)
    return seq


def test_a_decode_instance_matcher_takes_the_first_token_the_prefill_sampled(compiler):
    role = decode_role(compiler)
    seq = transferred(role, "d", YES_NO, TOKEN["y"])
    updates = []
    while not updates:  # received, held while compiling, then decoded
        wait_compiled(role)
        updates = forward(role)
    assert updates == [("d", [TOKEN["e"]], None, "")]  # "y" was taken: "e" must follow
    assert seq.guide is not None


def test_an_abort_while_compiling_frees_the_transferred_kv():
    ready = threading.Event()
    compiler = guided.GrammarCompiler(lambda: ready.wait(30) and tiny_info())
    role = decode_role(compiler)
    transferred(role, "d", AB, TOKEN["a"])
    forward(role)
    assert role.compiling and role.live_seq_ids() == {"d"} and not role.is_drained
    role.handle(AbortRequest("d", "client went away"))
    assert not role.compiling and role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks
    ready.set()
    compiler.close()
