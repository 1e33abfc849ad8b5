"""The probe's features: the target model's hidden states at the last prompt token.

Offline, `FeatureExtractor` runs prompts (cut to the cutting limit) through our `ModelRunner`
with `return_hidden=True`, several prompts per forward, and frees their KV blocks right after.
In serving the same vector comes out of the prefill instance's own forward (`ModelOutput.hidden`),
so the probe costs no extra forward there.

Features of a dataset split are cached in `DATASET/features/` (keyed by model, dtype and cut),
so training at several granularities, and evaluating later, extract them once.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from common.block_pool import KVCacheManager
from common.config import BatchConfig, CacheConfig, EngineConfig
from common.engine.model_runner import ModelRunner
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams
from length_predictor.base import DEFAULT_MAX_INPUT_TOKENS, cut_prompt

# The runner keeps hidden states only for rows it samples; greedy sampling is the cheapest.
_SAMPLE = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class ExtractOptions:
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS  # prompts are cut to this (head + tail)
    # Tokens per forward: several short prompts share one forward. Near the CPU prefill knee.
    tokens_per_forward: int = 512
    # Layers to keep (`BatchPlan.hidden_layers`); empty = the final hidden state alone.
    hidden_layers: tuple[int, ...] = ()


def extractor_config(config: EngineConfig, options: ExtractOptions) -> EngineConfig:
    """The target model's config with a KV cache just large enough for one forward."""
    block_size = config.cache.block_size
    num_tokens = max(options.tokens_per_forward, options.max_input_tokens)
    # A forward of k prompts wastes up to one partial block per prompt.
    num_blocks = 2 * (num_tokens // block_size + 1) + 8
    return EngineConfig(model=config.model, cache=CacheConfig(block_size=block_size,
                                                              num_blocks=num_blocks),
                        batch=BatchConfig(max_num_batched_tokens=num_tokens), seed=config.seed)


class FeatureExtractor:
    def __init__(self, runner: ModelRunner, options: ExtractOptions = ExtractOptions()) -> None:
        self.runner = runner
        self.options = options
        layout = runner.kv_layout
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size)

    @classmethod
    def from_config(cls, config: EngineConfig,
                    options: ExtractOptions = ExtractOptions()) -> FeatureExtractor:
        return cls(ModelRunner(extractor_config(config, options)), options)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        hidden_size = self.runner.model.shape.hidden_size
        layers = self.options.hidden_layers
        return (len(layers), hidden_size) if layers else (hidden_size,)

    @property
    def key(self) -> str:
        """Names the cache entry: the same model, dtype and cut give the same features."""
        runner = self.runner
        name = f"{runner.resolved.name}-{runner.dtype_name}-cut{self.options.max_input_tokens}"
        if self.options.hidden_layers:
            name += "-layers" + "_".join(map(str, self.options.hidden_layers))
        return re.sub(r"[^A-Za-z0-9_.-]", "_", name)

    def _batches(self, prompts: list[list[int]]) -> list[list[int]]:
        """Indices of the prompts of each forward, in order, within the token budget."""
        batches, current, used = [], [], 0
        for index, prompt in enumerate(prompts):
            if current and used + len(prompt) > self.options.tokens_per_forward:
                batches.append(current)
                current, used = [], 0
            current.append(index)
            used += len(prompt)
        return batches + ([current] if current else [])

    def _forward(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        chunks = []
        for i, prompt in enumerate(prompts):
            table = self.kv.grow(f"f{i}", len(prompt))
            chunks.append(ScheduledChunk(f"f{i}", prompt, 0, table, _SAMPLE))
        try:
            output = self.runner.execute(BatchPlan(
                chunks, return_hidden=True, hidden_layers=self.options.hidden_layers))
        finally:
            for chunk in chunks:
                self.kv.free(chunk.seq_id)
        return [output.hidden[chunk.seq_id] for chunk in chunks]

    def extract(self, prompts: list[list[int]], progress: bool = True) -> torch.Tensor:
        """`[len(prompts), *feature_shape]` float32 features, in input order."""
        cut = [cut_prompt(p, self.options.max_input_tokens) for p in prompts]
        if any(not p for p in cut):
            raise ValueError("cannot extract features of an empty prompt")
        out = torch.empty(len(cut), *self.feature_shape, dtype=torch.float32)
        batches = self._batches(cut)
        with tqdm(total=len(cut), desc="probe features", unit="prompt", file=sys.stderr,
                  disable=not progress) as bar:
            for batch in batches:
                for index, row in zip(batch, self._forward([cut[i] for i in batch])):
                    out[index] = row
                bar.update(len(batch))
        return out

    def close(self) -> None:
        self.runner.close()


def cached_features(extractor: FeatureExtractor, dataset_dir: Path, split: str,
                    example_ids: list[int], prompts: list[list[int]]) -> torch.Tensor:
    """Features of one dataset split, from `dataset_dir/features/` when already extracted."""
    path = dataset_dir / "features" / f"{extractor.key}-{split}.pt"
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved["example_ids"].tolist() == list(example_ids):
            return saved["features"]
    features = extractor.extract(prompts)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"example_ids": torch.tensor(example_ids), "features": features}, path)
    return features
