"""A small name -> implementation registry for pluggable parts (backends, policies, models)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """`@REG.register("name")` adds an implementation; `REG.get("name")` finds it or says what
    exists."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        def decorate(item: T) -> T:
            for name in names:
                if name in self._items and self._items[name] is not item:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self._items[name] = item
            return item
        return decorate

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") \
                from None

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> Iterable[tuple[str, T]]:
        return self._items.items()
