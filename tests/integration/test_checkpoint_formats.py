"""Checkpoint layouts the loader reads: sharded safetensors with an index, and the older config.json
spellings of Gemma 2/3 and Phi-3 (what checkpoints written before transformers 5 carry).

Each comparison loads the same weights twice and asks for bit-identical logits, so any tensor or
setting read differently shows.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import TINY_WINDOW, save_tiny_model, tiny_hf_model

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.model_runner import ModelRunner
from common.engine.weights import iter_weights
from common.errors import ModelLoadError
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams

VOCAB = 512  # no tokenizer: the runner takes token ids
PROMPT = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()


def last_logits(path) -> torch.Tensor:
    """The logits after PROMPT, in one forward (float32)."""
    runner = ModelRunner(EngineConfig(model=ModelConfig(path=str(path), dtype="float32"),
                                      cache=CacheConfig(num_blocks=16, block_size=16)))
    try:
        chunk = ScheduledChunk("p", PROMPT, 0, list(range(3)),
                               SamplingParams(max_tokens=1, temperature=0.0))
        return runner.execute(BatchPlan([chunk], return_logits=True)).logits["p"]
    finally:
        runner.close()


def test_sharded_checkpoint_loads_like_one_file(tmp_path):
    model = tiny_hf_model("llama", VOCAB)
    model.save_pretrained(str(tmp_path / "single"))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    # Files beside the shards that the index does not list are not read (Mistral repositories
    # ship consolidated.safetensors, with other tensor names).
    from safetensors.torch import save_file

    save_file({"unrelated": torch.zeros(2)}, str(tmp_path / "sharded" / "consolidated.safetensors"))
    assert torch.equal(last_logits(tmp_path / "sharded"), last_logits(tmp_path / "single"))
    shards[1].unlink()
    with pytest.raises(ModelLoadError, match=shards[1].name):
        next(iter_weights(tmp_path / "sharded"))


def legacy_spelling(kind: str, cfg: dict) -> dict:
    """`cfg` as transformers 4 wrote it: rope settings at the top level, no layer_types."""
    rope = cfg["rope_parameters"]
    cfg = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    if kind == "gemma2":
        cfg["rope_theta"] = rope["rope_theta"]
    elif kind == "gemma3":
        cfg.pop("_sliding_window_pattern", None)
        cfg.update(sliding_window_pattern=3, rope_theta=rope["full_attention"]["rope_theta"],
                   rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                   rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "phi3":
        cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=0.5,
                   rope_scaling={"type": "su", "short_factor": rope["short_factor"],
                                 "long_factor": rope["long_factor"]})
    return cfg


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_older_config_spellings_load_the_same_model(tmp_path, kind):
    new = save_tiny_model(kind, tmp_path / "new", None, VOCAB)
    old = tmp_path / "old"
    shutil.copytree(new, old)
    cfg = json.loads((new / "config.json").read_text())
    (old / "config.json").write_text(json.dumps(legacy_spelling(kind, cfg)))
    assert len(PROMPT) > TINY_WINDOW  # the windows and the local rope matter
    assert torch.equal(last_logits(old), last_logits(new))
