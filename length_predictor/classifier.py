"""The classifier kind: a small LM fine-tuned as `AutoModelForSequenceClassification` (TetriInfer).

The paper fine-tunes OPT-125M for OPT-13B. Model hubs are out of reach here, so the default
backbone is the checkpoint that ships locally: the default target model's own Hugging Face
directory (SmolLM2-135M-Instruct), cut to its bottom `num_layers` layers so it is cheaper than
the model it predicts for: 18 of 30 by default, because the probe's layer study
(docs/length_predictor.md) found the output length best read from the middle layers up, and a
6-layer cut scored near the majority answer. Any local checkpoint works (`--backbone DIR`, e.g.
OPT-125M with `--num-layers 0`).

Training uses the transformers `Trainer`; to fit a 2-core CPU, only the top `train_layers`
layers, the final norm and the new head are trained, in bfloat16 autocast, with batches grouped
by length so padding stays small. Inputs are the target model's prompt tokens cut to the cutting
limit; a backbone with another tokenizer gets them re-tokenized through text.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.engine.cpu_features import default_cpu_dtype
from common.errors import InvalidRequestError, ModelLoadError
from length_predictor.base import (
    LengthPredictor,
    LoadOptions,
    PredictorMeta,
    cut_prompt,
)

MODEL_DIR, TARGET_TOKENIZER_DIR = "model", "target_tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ClassifierOptions:
    backbone: str | None = None  # local HF checkpoint; None = the target model's directory
    num_layers: int = 18  # keep the bottom N transformer layers; 0 = all
    train_layers: int = 2  # top layers trained with the final norm and head; -1 = all
    max_steps: int = 400
    batch_size: int = 16
    learning_rate: float = 3e-4
    warmup_fraction: float = 0.1  # of max_steps, linear warm-up then linear decay
    weight_decay: float = 0.0
    bf16: bool = True  # bfloat16 autocast: about 3x faster than float32 on AVX-512 BF16 CPUs
    seed: int = 0


class TokenBridge:
    """Target-model token ids -> backbone token ids (identity when the tokenizers match)."""

    def __init__(self, target_dir: Path | None, backbone_dir: Path) -> None:
        from common.tokenizer import TextTokenizer

        self.target = self.backbone = None
        target_file, backbone_file = (None if target_dir is None else target_dir / "tokenizer.json",
                                      backbone_dir / "tokenizer.json")
        if (target_file is not None and target_file.is_file() and backbone_file.is_file()
                and target_file.read_bytes() != backbone_file.read_bytes()):
            self.target, self.backbone = TextTokenizer(target_dir), TextTokenizer(backbone_dir)

    @property
    def retokenizes(self) -> bool:
        return self.target is not None

    def __call__(self, token_ids: list[int]) -> list[int]:
        if self.target is None:
            return list(token_ids)
        text = self.target.decode(token_ids, skip_special_tokens=False)
        return self.backbone.encode(text, add_special_tokens=False)


def pad_token_for(config) -> int:
    """A padding id unlikely to end a real prompt: the sequence-classification head reads the
    last non-padding token, and SmolLM2's pad (<|im_end|>) closes every chat turn."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    pad = config.pad_token_id
    return 0 if pad is None or pad in eos else int(pad)


def collate(features: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest prompt of the batch (as the paper's HF predictor does)."""
    longest = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(features), longest), dtype=torch.long)
    for row, feature in enumerate(features):
        ids = feature["input_ids"]
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, :len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if "labels" in features[0]:
        batch["labels"] = torch.tensor([f["labels"] for f in features], dtype=torch.long)
    return batch


def _layer_list(model: torch.nn.Module) -> torch.nn.ModuleList:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("layers"):
            return module
    raise ModelLoadError(f"cannot find the transformer layers of {type(model).__name__}")


def freeze_for_training(model: torch.nn.Module, train_layers: int) -> int:
    """Train the top `train_layers` layers, norms outside the layers and the head; return the
    number of trainable parameters. Embeddings and lower layers stay frozen."""
    if train_layers < 0:
        return sum(p.numel() for p in model.parameters())
    layers = _layer_list(model)
    for param in model.parameters():
        param.requires_grad = False
    in_layers = {id(p) for p in layers.parameters()}
    trainable = [p for layer in list(layers)[len(layers) - train_layers:]
                 for p in layer.parameters()] if train_layers else []
    for name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        if name.split(".")[-1] in ("score", "classifier") or is_norm:
            trainable += [p for p in module.parameters() if id(p) not in in_layers]
    for param in trainable:
        param.requires_grad = True
    return sum(p.numel() for p in {id(p): p for p in trainable}.values())


def load_backbone(backbone_dir: Path, num_buckets: int, num_layers: int,
                  dtype: torch.dtype = torch.float32):
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    if not (backbone_dir / "config.json").is_file():
        raise ModelLoadError(f"classifier backbone is not a Hugging Face directory: {backbone_dir}")
    config = AutoConfig.from_pretrained(backbone_dir, num_labels=num_buckets)
    if num_layers:
        config.num_hidden_layers = min(num_layers, config.num_hidden_layers)
    config.pad_token_id = pad_token_for(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped top layers and the new head are expected
    try:
        return AutoModelForSequenceClassification.from_pretrained(backbone_dir, config=config,
                                                                  dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)


def fit(model, examples: list[dict], options: ClassifierOptions) -> dict:
    """Fine-tune with the transformers Trainer; `examples` are {"input_ids", "labels"} dicts."""
    from transformers import Trainer, TrainingArguments

    pad = model.config.pad_token_id
    with tempfile.TemporaryDirectory(prefix="lp-trainer-") as scratch:
        args = TrainingArguments(
            output_dir=scratch, max_steps=options.max_steps,
            per_device_train_batch_size=options.batch_size, learning_rate=options.learning_rate,
            warmup_steps=int(options.max_steps * options.warmup_fraction),
            weight_decay=options.weight_decay,
            lr_scheduler_type="linear", bf16=options.bf16, use_cpu=not torch.cuda.is_available(),
            seed=options.seed, logging_steps=max(1, options.max_steps // 10),
            save_strategy="no", report_to="none", dataloader_num_workers=0,
            train_sampling_strategy="group_by_length", remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=examples,
                          data_collator=lambda batch: collate(batch, pad))
        result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"train_loss": result.training_loss, "loss_log": losses,
            "train_runtime_s": round(result.metrics.get("train_runtime", 0.0), 1)}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


class ClassifierPredictor(LengthPredictor):
    kind = "classifier"

    def __init__(self, meta: PredictorMeta, model, bridge: TokenBridge,
                 source_dirs: tuple[Path, Path | None] | None = None, batch_size: int = 16) -> None:
        super().__init__(meta)
        self.model = model.eval()
        self.bridge = bridge
        self.batch_size = batch_size
        # (backbone dir, target tokenizer dir) whose tokenizers `save` copies.
        self.source_dirs = source_dirs

    def predict_buckets(self, prompts: list[list[int]]) -> list[int]:
        inputs = [cut_prompt(self.bridge(p), self.meta.max_input_tokens) for p in prompts]
        if any(not ids for ids in inputs):
            raise InvalidRequestError("cannot predict the length of an empty prompt")
        # Shortest first, so each padded batch wastes little; results go back in input order.
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        buckets = [0] * len(inputs)
        device = next(self.model.parameters()).device
        pad = self.model.config.pad_token_id
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                batch = collate([{"input_ids": inputs[i]} for i in rows], pad)
                logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits
                for row, bucket in zip(rows, logits.argmax(-1).tolist()):
                    buckets[row] = bucket
        return buckets

    def save_weights(self, directory: Path) -> None:
        self.model.save_pretrained(directory / MODEL_DIR, safe_serialization=True)
        if self.source_dirs is not None:
            backbone_dir, target_dir = self.source_dirs
            _copy_tokenizer(backbone_dir, directory / MODEL_DIR)
            if self.bridge.retokenizes and target_dir is not None:
                _copy_tokenizer(target_dir, directory / TARGET_TOKENIZER_DIR)

    @classmethod
    def load_weights(cls, meta: PredictorMeta, directory: Path,
                     options: LoadOptions) -> ClassifierPredictor:
        from transformers import AutoModelForSequenceClassification

        model_dir = directory / MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise InvalidRequestError(f"classifier weights missing: {model_dir}")
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=inference_dtype(options.dtype, options.device)).to(options.device)
        target_dir = directory / TARGET_TOKENIZER_DIR
        bridge = TokenBridge(target_dir if target_dir.is_dir() else None, model_dir)
        return cls(meta, model, bridge, (model_dir, target_dir if target_dir.is_dir() else None))


def inference_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        if device.startswith("cuda"):
            return torch.float16
        return getattr(torch, default_cpu_dtype())
    return getattr(torch, name)


def classifier_hyperparameters(options: ClassifierOptions, backbone_dir: Path,
                               num_trainable: int, bridge: TokenBridge) -> dict:
    return {**asdict(options), "backbone_dir": str(backbone_dir),
            "num_trainable_params": num_trainable, "retokenized": bridge.retokenizes}
