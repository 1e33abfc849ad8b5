"""Choosing the decode instance for a prefilled sequence.

`round_robin` cycles over the decode instances the cluster monitor last broadcast. The
length-aware power-of-two dispatcher of TetriInfer §3.3.4 registers here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from common.protocol import PeerInfo
from common.registry import Registry
from common.sequence import Sequence

DISPATCHERS: Registry[type["Dispatcher"]] = Registry("dispatch policy")


class Dispatcher(ABC):
    @abstractmethod
    def pick(self, seq: Sequence, decodes: list[PeerInfo]) -> PeerInfo | None:
        """The decode instance for `seq`, or None to hold it until the view changes."""


@DISPATCHERS.register("round_robin")
class RoundRobin(Dispatcher):
    def __init__(self) -> None:
        self.counter = 0

    def pick(self, seq: Sequence, decodes: list[PeerInfo]) -> PeerInfo | None:
        if not decodes:
            return None
        ordered = sorted(decodes, key=lambda p: p.instance_id)
        choice = ordered[self.counter % len(ordered)]
        self.counter += 1
        return choice
