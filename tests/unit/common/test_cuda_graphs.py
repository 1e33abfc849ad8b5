"""Decode steps through common.engine.cuda_graphs, on CPU: the buckets, which plans take the
graph path, the padding of a decode batch to its bucket and the un-padding of the output, and
the runner's hook.

The capture itself only runs on CUDA; here `DecodeGraphs(capture=False)` runs each bucket's
forward eagerly over the same fixed-address inputs, standing in for the replay: on CPU with the
Triton kernel under its interpreter (tests/conftest.py), on a GPU host with the compiled kernel.
Replay on a GPU: tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from common.block_pool import KVCacheManager  # noqa: E402
from common.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from common.engine.attention import Segment, TorchAttention  # noqa: E402
from common.engine.cuda_graphs import DecodeGraphs, batch_buckets, bucket_for  # noqa: E402
from common.engine.kv_cache import KVCache, KVLayout  # noqa: E402
from common.engine.model_runner import FlatBatch, ModelRunner  # noqa: E402
from common.engine.models import build_model  # noqa: E402
from common.plan import BatchPlan, ScheduledChunk  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

# head_dim 32, three query heads per KV head
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 3,
          "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
BLOCK_SIZE = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face names and random float32 tensors of CONFIG's model."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = hidden // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.2  # noqa: E731
    weights = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(CONFIG["num_hidden_layers"]):
        shapes = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                  "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
                  "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                  "mlp.down_proj": (hidden, inter)}
        for name, shape in shapes.items():
            weights[f"model.layers.{i}.{name}.weight"] = (
                torch.ones(shape) if len(shape) == 1 else rand(*shape))
    return weights


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG, tiny_weights().items(), torch.float32, DEVICE)


def new_cache(model, num_blocks: int = 48) -> KVCache:
    shape = model.shape
    return KVCache(KVLayout(shape.num_layers, num_blocks, BLOCK_SIZE, shape.num_kv_heads,
                            shape.head_dim, "float32"), DEVICE)


def batch_of(specs) -> FlatBatch:
    """A flat batch of (num_tokens, num_cached, block_ids[, store]) segments, tokens 5, 6, ..."""
    segments, row = [], 0
    for spec in specs:
        segments.append(Segment(row, *spec))
        row += spec[0]
    ids = torch.arange(5, 5 + row)
    positions = torch.tensor([p for s in segments for p in range(s.num_cached, s.num_context)],
                             dtype=torch.long)
    return FlatBatch(ids.to(DEVICE), positions.to(DEVICE), segments, [], [])


def test_buckets_are_powers_of_two_then_multiples_of_eight():
    assert batch_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(100)[-3:] == [88, 96, 104]  # the largest bucket holds max_batch


def test_every_batch_gets_the_smallest_bucket_that_holds_it():
    buckets = batch_buckets(256)
    for batch in range(1, 257):
        bucket = bucket_for(batch, buckets)
        assert bucket >= batch and bucket - batch < 8
        assert all(b < batch for b in buckets if b < bucket)
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(257, buckets)


def test_only_pure_decode_plans_within_the_buckets_take_the_graph_path(model):
    graphs = DecodeGraphs(model, new_cache(model), max_batch=4, max_context=64, capture=False)
    decode = [(1, 10, [0]), (1, 20, [1, 2]), (1, 63, [3, 4, 5, 6])]
    plan = BatchPlan([])
    assert graphs.can_run(plan, batch_of(decode))
    assert graphs.can_run(BatchPlan([], return_hidden=True), batch_of(decode))  # final state
    assert not graphs.can_run(plan, batch_of(decode + [(5, 0, [7])]))  # a prefill chunk too
    assert not graphs.can_run(plan, batch_of([(3, 2, [7])]))
    assert not graphs.can_run(plan, batch_of(decode + [(1, 0, [], False)]))  # padding rows
    assert not graphs.can_run(plan, batch_of(decode * 2))  # 6 > the largest bucket, 4
    assert not graphs.can_run(plan, batch_of([(1, 64, [0, 1, 2, 3, 4])]))  # past the table
    assert not graphs.can_run(BatchPlan([], swap_in=[(0, 1)]), batch_of(decode))
    assert not graphs.can_run(BatchPlan([], return_hidden=True, hidden_layers=(1,)),
                              batch_of(decode))
    assert not graphs.can_run(plan, batch_of([]))


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Slots (block * BLOCK_SIZE + offset) whose keys or values changed in any layer."""
    changed = (before != after).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    return set(changed.flatten().nonzero().flatten().tolist())


def test_padded_replay_equals_the_eager_forward_and_writes_only_real_slots(model):
    """Steps of 3, 5, 1, 8, 2 sequences (buckets 4, 8, 1, 8, 2): a row that was real in one
    step is padding in the next, so stale inputs must not leak into outputs or the cache."""
    eager_cache, graph_cache = new_cache(model, 64), new_cache(model, 64)
    eager_cache.tensor.copy_(torch.randn(eager_cache.tensor.shape,
                                         generator=torch.Generator().manual_seed(1)))
    graph_cache.tensor.copy_(eager_cache.tensor)
    graphs = DecodeGraphs(model, graph_cache, max_batch=8, max_context=128, capture=False)
    cached = [0, 5, 15, 16, 31, 40, 63, 100]
    tables = [list(range(8 * i, 8 * i + 8))[::-1] for i in range(len(cached))]
    for step in ([0, 1, 2], [3, 4, 5, 6, 7], [7], list(range(8)), [6, 2]):
        batch = batch_of([(1, cached[s], tables[s]) for s in step])
        want = model(batch.input_ids, batch.positions,
                     TorchAttention(batch.segments, eager_cache, model.ops))
        before = graph_cache.tensor.clone()
        got = graphs.run(batch)
        assert got.shape == want.shape  # un-padded to the batch
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        slots = {tables[s][cached[s] // BLOCK_SIZE] * BLOCK_SIZE + cached[s] % BLOCK_SIZE
                 for s in step}
        assert changed_slots(before, graph_cache.tensor) == slots
        torch.testing.assert_close(graph_cache.tensor, eager_cache.tensor, atol=1e-5, rtol=1e-5)
        for s in step:
            cached[s] += 1


class CountingGraphs:
    """DecodeGraphs that count the plans they ran."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs, self.runs = graphs, 0

    def can_run(self, plan, batch):
        return self.graphs.can_run(plan, batch)

    def run(self, batch):
        self.runs += 1
        return self.graphs.run(batch)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny-llama")
    save_file(tiny_weights(), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def runner_for(checkpoint) -> ModelRunner:
    model = ModelConfig(path=str(checkpoint), dtype="float32", device=DEVICE, cuda_graphs=False)
    return ModelRunner(EngineConfig(model=model, cache=CacheConfig(block_size=BLOCK_SIZE,
                                                                   num_blocks=48)))


def chunk(kv, seq_id, tokens, num_cached, sampled=True):
    blocks = kv.grow(seq_id, num_cached + len(tokens))
    return ScheduledChunk(seq_id, tokens, num_cached, blocks, GREEDY if sampled else None)


def run_script(runner: ModelRunner) -> list[dict]:
    """Prefills, decode steps of 3 sequences, a mixed step, decode steps of 4 and then 5
    sequences (past the largest bucket, 4): the sampled tokens and logits of every step."""
    kv = KVCacheManager(runner.kv_layout.num_blocks, BLOCK_SIZE)
    prompts = {f"s{i}": list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 20, 17, 9, 2])}
    lengths = {s: len(p) for s, p in prompts.items()}
    last, outputs = {}, []

    def step(chunks):
        output = runner.execute(BatchPlan(chunks, return_logits=True))
        outputs.append(output)
        for seq_id, token in output.sampled_token_ids.items():
            last[seq_id] = token
            lengths[seq_id] += 1

    def decode(seq_ids):
        step([chunk(kv, s, [last[s]], lengths[s] - 1) for s in seq_ids])

    step([chunk(kv, s, prompts[s], 0) for s in ("s0", "s1", "s2")])
    for _ in range(3):
        decode(["s0", "s1", "s2"])
    step([chunk(kv, "s1", [last["s1"]], lengths["s1"] - 1), chunk(kv, "s3", prompts["s3"], 0)])
    step([chunk(kv, "s4", prompts["s4"], 0)])
    for seq_ids in (["s0", "s1", "s2", "s3"], ["s0", "s1", "s2", "s3", "s4"]):
        decode(seq_ids)
    return outputs


def test_runner_replays_decode_steps_and_runs_other_plans_eagerly(checkpoint):
    eager, graphed = runner_for(checkpoint), runner_for(checkpoint)
    assert eager.graphs is None  # turned off (and never captured on CPU)
    counting = CountingGraphs(DecodeGraphs(graphed.model, graphed.kv_cache, max_batch=4,
                                           max_context=graphed.max_model_len, capture=False))
    graphed.graphs = counting
    want, got = run_script(eager), run_script(graphed)
    assert counting.runs == 4  # 3 steps of 3 sequences, 1 of 4; not the prefills, the mixed
    # step or the 5-sequence step
    for expected, actual in zip(want, got):
        assert actual.sampled_token_ids == expected.sampled_token_ids
        for seq_id, logits in expected.logits.items():
            torch.testing.assert_close(actual.logits[seq_id], logits, atol=1e-4, rtol=1e-4)
