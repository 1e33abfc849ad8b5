"""CUDA graphs for decode steps: the batch buckets, the fixed-address inputs, capture and replay.

Why: on an H100 a decode step at batch 1 took 14.6 ms against 0.72 ms to read the weights; the
time went to launching each layer's kernels from Python. A captured graph replays the whole
forward (embedding, layers, final norm) with one launch.

- Buckets: 1, 2, 4, 8, then multiples of 8 up to the largest batch. A step of b decode tokens
  replays the graph of the smallest bucket >= b. Its extra rows are padding: token 0 at
  position 0, cache slot -1 (the store kernel skips it) and context length 0 (the attention
  kernel writes zeros); their output rows are dropped.
- Inputs: every graph reads the same fixed-address tensors (token ids, positions, slots,
  context lengths, block ids: `StaticInputs`), which a step fills before the replay: one
  host-to-device copy of the used part of a pinned staging buffer plus one device copy of the
  token ids. Attention goes through the Triton kernel (`common.engine.attention_triton`) over
  those tensors; the block-id buffer holds every row at the longest context the model takes.
- Which plans replay (`DecodeGraphs.can_run`): every chunk one token, no padding rows, no swaps,
  no intermediate hidden states asked for, at most the largest bucket of sequences. Every
  other plan (prefill chunks, mixed batches, swaps, probes) runs the eager forward.
- Memory: graphs are captured largest first into one shared pool, so the pool holds about one
  forward's activations at the largest bucket. The block-id buffer is the largest bucket x
  (context limit / block size) int32, on the device and pinned on the host (256 rows at 8,192
  tokens in blocks of 16: 0.5 MB each).

The capture itself only runs on CUDA (`torch.cuda.CUDAGraph`). With `capture=False` each
bucket's forward runs eagerly over the same static buffers: that is how the CPU tests check
the buckets, the padding and un-padding and which plans take this path
(tests/unit/common/test_cuda_graphs.py, the Triton kernel under its interpreter); replay on a GPU
is checked by tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from common.engine.attention_triton import PagedIndex, TritonAttention
from common.engine.kv_cache import KVCache
from common.plan import BatchPlan

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to the first bucket >= max_batch."""
    candidates = [1, 2, 4, *range(8, max_batch + 8, 8)]
    largest = next(b for b in candidates if b >= max_batch)
    return [b for b in candidates if b < max_batch] + [largest]


def bucket_for(batch: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `batch` rows (ValueError past the largest)."""
    position = bisect.bisect_left(buckets, batch)
    if position == len(buckets):
        raise ValueError(f"batch {batch} exceeds the largest graph bucket {buckets[-1]}")
    return buckets[position]


class StaticInputs:
    """The fixed-address tensors every captured graph reads, and the host buffer that fills
    them. Rows are sequences (one decode token each); row i of a bucket is sequence i."""

    def __init__(self, max_batch: int, width: int, device: torch.device) -> None:
        self.max_batch = max_batch
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, **int32)
        # positions | slots | context lengths | block offsets | block ids (at most `width` per
        # row): one buffer, so a step is one copy of the used prefix
        size = 4 * max_batch + max_batch * width
        self.flat = torch.zeros(size, **int32)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_parts = self._split(self.host.numpy())
        (self.positions, self.slots, self.context_lens, self.block_offsets,
         self.block_ids) = self._split(self.flat)
        self.slots.fill_(-1)  # captured with every row padding: nothing is written
        self.rows = torch.arange(max_batch, **int32)  # row i: sequence i, and its only tile
        self.ones = torch.ones(max_batch, **int32)
        self.zeros = torch.zeros(max_batch, **int32)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def _split(self, flat):
        batch = self.max_batch
        return (*(flat[i * batch:(i + 1) * batch] for i in range(4)), flat[4 * batch:])

    def index(self, bucket: int) -> PagedIndex:
        """The kernel's view of the first `bucket` rows: one-token sequences, one tile each."""
        rows = self.rows[:bucket]
        return PagedIndex(self.slots[:bucket], rows, self.ones[:bucket],
                          self.context_lens[:bucket], self.block_offsets[:bucket],
                          self.block_ids, rows, self.zeros[:bucket], tile_tokens=1)

    def load(self, input_ids: torch.Tensor, segments, bucket: int, block_size: int) -> None:
        """Write a decode batch into rows 0..len(segments)-1, rows up to `bucket` as padding."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        positions, slots, contexts, offsets, blocks = self.host_parts
        for part, value in ((positions, 0), (slots, -1), (contexts, 0), (offsets, 0)):
            part[:bucket] = value
        used = 0
        for row, seg in enumerate(segments):
            pos = seg.num_cached  # the one new token's position and slot
            positions[row], contexts[row], offsets[row] = pos, seg.num_context, used
            slots[row] = seg.block_ids[pos // block_size] * block_size + pos % block_size
            needed = -(-seg.num_context // block_size)
            blocks[used:used + needed] = seg.block_ids[:needed]
            used += needed
        end = 4 * self.max_batch + used
        self.flat[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.input_ids[:len(segments)].copy_(input_ids)


class DecodeGraphs:
    """The decode forward at every bucket: captured graphs on CUDA, eager stand-ins with
    `capture=False` (CPU tests). The runner asks `can_run(plan, batch)`, then `run(batch)`."""

    def __init__(self, model, kv_cache: KVCache, max_batch: int, max_context: int,
                 capture: bool = True) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.layout.block_size
        width = -(-max_context // self.block_size)
        self.max_context = width * self.block_size
        self.buckets = batch_buckets(max_batch)
        self.inputs = StaticInputs(self.buckets[-1], width, kv_cache.device)
        self.pool = None  # the memory pool every graph shares, set by the first capture
        self.replays = {}
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            self.replays[bucket] = self._capture(bucket) if capture else self._eager(bucket)

    def _eager(self, bucket: int):
        attention = TritonAttention.over(self.kv_cache, self.inputs.index(bucket))
        input_ids, positions = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
        return lambda: self.model(input_ids, positions, attention)

    def _capture(self, bucket: int):
        forward = self._eager(bucket)
        # Warm up outside the capture (Triton compiles, cuBLAS picks its kernels), on a side
        # stream as torch's capture wants.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a KV transfer) do not break this capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output
        return replay

    def can_run(self, plan: BatchPlan, batch) -> bool:
        """Whether this plan's forward is a decode step a graph covers."""
        if plan.has_swaps or (plan.return_hidden and plan.hidden_layers):
            return False
        segments = batch.segments
        return 0 < len(segments) <= self.buckets[-1] and all(
            s.num_tokens == 1 and s.store and s.num_context <= self.max_context
            for s in segments)

    def run(self, batch) -> torch.Tensor:
        """The final hidden states [len(batch.segments), hidden] of a decode step. The tensor
        is the graph's output buffer: read it before the next step."""
        count = len(batch.segments)
        bucket = bucket_for(count, self.buckets)
        self.inputs.load(batch.input_ids, batch.segments, bucket, self.block_size)
        return self.replays[bucket]()[:count]


def for_runner(runner) -> DecodeGraphs | None:
    """Captured decode graphs for a runner on CUDA with the Triton attention kernel, unless
    turned off (ModelConfig.cuda_graphs); None everywhere else."""
    config = runner.config
    if (runner.device.type != "cuda" or not config.model.cuda_graphs
            or runner.attention_cls is not TritonAttention):
        return None
    max_batch = min(config.model.cuda_graph_max_batch, config.batch.max_num_seqs)
    started = time.perf_counter()
    with torch.inference_mode():
        graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch, runner.max_model_len)
    log.info("captured decode graphs for batches %s in %.1f s", graphs.buckets,
             time.perf_counter() - started)
    return graphs
