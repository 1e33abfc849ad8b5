"""Choosing the decode instance for a sequence (TetriInfer §3.3.4), as pure functions of the
cluster monitor's last broadcast (`PeerInfo` per decode instance) and the sequence's predicted
output length.

`power_of_two` (the paper's): split the decode instances into alpha, those with enough free KV
blocks for the prompt plus the predicted output, and beta, the rest. Pick two at random from
alpha and keep the one that would suffer the least interference: for a heavy sequence the one
with fewer heavy decodes after placement (then fewer decodes), for a light one the one with
fewer decodes (then fewer heavy). With one member in alpha take it; with none, take the beta
instance with the most free blocks, or hold the sequence until room appears (`hold_when_full`).

`power_of_two_ratio` keeps the paper's literal comparison, the lower heavy:light ratio after
placement. It feeds on itself: an instance with more light decodes has the lower ratio, so it
draws the next light *and* the next heavy decode (measured: 44 of 64 requests on one of two
instances, a longer total decoding time than random placement; docs/reproduction.md).

Cache-aware (both power-of-two readings): the gateway passes the decode instances that hold a
prefix of the prompt in their prefix cache (`SequenceMeta.decode_cached`); the one holding the
most always takes the place of the second random candidate, and between the two the paper's
interference cost decides first, the cached tokens next (fewer blocks to read, and the later
turns of a conversation stay where their history is cached).

For comparison: `random`, `round_robin`, `least_loaded` (most free blocks, then fewest
running), and `imbalance` (every heavy decode to the same instance: the paper's worst case).
Policies are found by name in `common.plugins.DISPATCH_POLICIES` (entry points
`splitserve.dispatch_policies`).

The `PeerInfo`s a policy gets are current: each decode instance's last report counts every
sequence offered there and not finished (waiting, being read, decoding) and leaves the blocks
waiting offers will take out of the free ones (control_plane/cluster.py), and the hand-offs add
this prefill instance's own placements that no report shows yet (prefill_instance/placements.py:
each one counted from its offer until the decode instance's report acknowledges the offer's
number, never twice). A burst of offers between two views therefore spreads as if each
placement had been reported at once.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from common.config import PredictionConfig
from common.protocol import LengthPrediction, PeerInfo
from common.sequence import Sequence


@dataclass(frozen=True)
class DispatchOptions:
    # heavy/light and which end of the predicted range (the decode admission reads the same)
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    hold_when_full: bool = False  # with an empty alpha set: hold instead of the roomiest beta
    block_size: int = 16
    seed: int | None = None


def blocks_needed(seq: Sequence, prediction: LengthPrediction | None,
                  options: DispatchOptions) -> int:
    output = options.prediction.predicted_output(prediction) or 1
    return -(-(seq.num_tokens + output) // options.block_size)


def interference_after(peer: PeerInfo, heavy: bool) -> tuple[int, int]:
    """What joining `peer` costs a sequence: heavy decodes compete with heavy ones, light decodes
    with every running decode; counts after placement, the deciding one first."""
    num_heavy = peer.num_heavy + (1 if heavy else 0)
    num_running = peer.num_heavy + peer.num_light + 1
    return (num_heavy, num_running) if heavy else (num_running, num_heavy)


def heavy_light_ratio(peer: PeerInfo, heavy: bool) -> float:
    """The peer's heavy:light ratio if this sequence joined it."""
    num_heavy = peer.num_heavy + (1 if heavy else 0)
    num_light = peer.num_light + (0 if heavy else 1)
    return num_heavy / max(num_light, 1)


class Dispatcher(ABC):
    def __init__(self, options: DispatchOptions = DispatchOptions()) -> None:
        self.options = options
        self.rng = random.Random(options.seed)

    @abstractmethod
    def pick(self, seq: Sequence, decodes: list[PeerInfo]) -> PeerInfo | None:
        """The decode instance for `seq`, or None to hold it until the view changes."""


class RoundRobin(Dispatcher):
    def __init__(self, options: DispatchOptions = DispatchOptions()) -> None:
        super().__init__(options)
        self.counter = 0

    def pick(self, seq, decodes):
        if not decodes:
            return None
        ordered = sorted(decodes, key=lambda p: p.instance_id)
        choice = ordered[self.counter % len(ordered)]
        self.counter += 1
        return choice


class RandomChoice(Dispatcher):
    def pick(self, seq, decodes):
        return self.rng.choice(sorted(decodes, key=lambda p: p.instance_id)) if decodes else None


class LeastLoaded(Dispatcher):
    def pick(self, seq, decodes):
        if not decodes:
            return None
        return max(decodes, key=lambda p: (p.num_free_blocks, -p.num_running, p.instance_id))


class PowerOfTwo(Dispatcher):
    def pick(self, seq, decodes):
        if not decodes:
            return None
        prediction = seq.meta.prediction
        needed = blocks_needed(seq, prediction, self.options)
        alpha = sorted((p for p in decodes if p.num_free_blocks >= needed),
                       key=lambda p: p.instance_id)
        if len(alpha) >= 2:
            heavy = self.options.prediction.is_heavy(prediction)
            pair = self.rng.sample(alpha, 2)
            cached = seq.meta.decode_cached
            holder = max(alpha, key=lambda p: (cached.get(p.instance_id, 0), p.instance_id))
            if cached.get(holder.instance_id, 0) and holder not in pair:
                pair[1] = holder  # the instance holding the prompt's prefix always competes
            return min(pair, key=lambda p: (*self.cost(p, heavy), -cached.get(p.instance_id, 0),
                                            -p.num_free_blocks))
        if alpha:
            return alpha[0]
        if self.options.hold_when_full:
            return None
        return max(decodes, key=lambda p: (p.num_free_blocks, p.instance_id))

    @staticmethod
    def cost(peer: PeerInfo, heavy: bool) -> tuple:
        return interference_after(peer, heavy)


class PowerOfTwoRatio(PowerOfTwo):
    """The paper's literal rule: the lower heavy:light ratio after placement."""

    @staticmethod
    def cost(peer: PeerInfo, heavy: bool) -> tuple:
        return (heavy_light_ratio(peer, heavy),)


class Imbalance(RoundRobin):
    """Heavy decodes always to the same instance, light ones to the others in turn."""

    def pick(self, seq, decodes):
        ordered = sorted(decodes, key=lambda p: p.instance_id)
        if len(ordered) <= 1 or self.options.prediction.is_heavy(seq.meta.prediction):
            return ordered[0] if ordered else None
        self.counter += 1
        return ordered[1 + self.counter % (len(ordered) - 1)]
