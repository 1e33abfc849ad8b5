"""Name -> implementation registries for pluggable parts (backends, policies, models, roles).

A registry is filled in one of two ways: by `@REG.register("name")` in the implementation's own
module, or from a pyproject entry-point group (`Registry(kind, group=...)`), so that a package
may find implementations that live in packages it must not import. Entry points are read on the
first lookup and each one is imported only when its name is asked for: listing the names never
imports an implementation (a CLI can offer every backend's name without loading torch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from common.errors import SplitserveError

T = TypeVar("T")


class UnknownNameError(SplitserveError, KeyError):
    """No implementation has this name; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class Registry(Generic[T]):
    """`@REG.register("name")` adds an implementation; `REG.get("name")` finds it or says what
    exists. With `group`, the entry points of that group are registered too."""

    def __init__(self, kind: str, group: str = "") -> None:
        self.kind = kind
        self.group = group
        self._items: dict[str, T] = {}
        self._unloaded: dict[str, Callable[[], T]] | None = None if group else {}

    def register(self, *names: str) -> Callable[[T], T]:
        def decorate(item: T) -> T:
            for name in names:
                if name in self._items and self._items[name] is not item:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self._items[name] = item
            return item
        return decorate

    def _entry_points(self) -> dict[str, Callable[[], T]]:
        if self._unloaded is None:
            self._unloaded = {ep.name: ep.load for ep in entry_points(group=self.group)
                              if ep.name not in self._items}
        return self._unloaded

    def get(self, name: str) -> T:
        if name not in self._items and name in self._entry_points():
            self.register(name)(self._unloaded[name]())  # an import error leaves it listed
            del self._unloaded[name]
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: "
                                   f"{', '.join(self.names())}") from None

    def load_all(self) -> dict[str, T]:
        """Every implementation, imported now (e.g. so a later switch only constructs one)."""
        return {name: self.get(name) for name in self.names()}

    def unregister(self, name: str) -> None:
        """Forget a name given to `register` (a test's throwaway plug-in)."""
        self._items.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._entry_points()

    def __iter__(self) -> Iterator[str]:
        """The names, so that a registry serves as argparse `choices`."""
        return iter(self.names())

    def names(self) -> list[str]:
        return sorted({*self._items, *self._entry_points()})

    def items(self) -> Iterable[tuple[str, T]]:
        return self.load_all().items()
