"""A config tree (common.config) as JSON and back: how `splitserve up` hands each instance process
its InstanceConfig. Decoding fills defaults, runs every `__post_init__` check and refuses an
unknown field, so a misspelt setting is an error rather than silently dropped.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import TypeVar, get_type_hints

import msgspec

from common.config import ConfigError, _require

Config = TypeVar("Config")


def config_to_json(config) -> str:
    """A config tree as JSON; `config_from_json(text, type(config))` gives it back."""
    return msgspec.json.encode(config).decode()


def config_from_json(text: str | bytes, kind: type[Config]) -> Config:
    """The config tree of class `kind` from JSON. Missing fields take their defaults, every value
    passes the checks of `__post_init__`, and an unknown field (a typo) is refused."""
    try:
        data = msgspec.json.decode(text)
        _refuse_unknown_fields(data, kind, "")
        return msgspec.convert(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"bad {kind.__name__} JSON: {exc}") from None


def _refuse_unknown_fields(data, kind: type, where: str) -> None:
    # msgspec ignores fields a dataclass lacks; a misspelt setting must not be dropped silently.
    if not isinstance(data, dict):
        return  # msgspec reports the wrong type
    hints = get_type_hints(kind)
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(data) - names)
    _require(not unknown, f"unknown {kind.__name__} field(s): "
                          f"{', '.join(where + name for name in unknown)}")
    for name, value in data.items():
        if is_dataclass(hints[name]):
            _refuse_unknown_fields(value, hints[name], f"{where}{name}.")
