"""Running a loaded predictor inside the prefill instance (TetriInfer §3.3.2).

`PredictorService` is the only object the prefill role talks to. Its life cycle:

    submit(seq_id, prompt)   at admission (kinds that read tokens: the classifier)
    <main model forwards>    parallel mode: the predictor runs meanwhile on its own thread
    poll() / wait(ids)       collect {seq_id: LengthPrediction}; sequential mode runs the
                             pending predictions here, in the caller's thread, before returning
    from_hidden(hidden)      kinds that read hidden states (the probe): predictions straight from
                             the prefill forward's `ModelOutput.hidden`, no extra forward
    discard(seq_id)          an aborted request: its prediction is dropped
    close()                  stop the thread

Batching follows the paper: prompts are padded to the longest of their batch (the HF model
cannot do chunked prefill), so a prompt longer than the cutting limit runs alone; the predictor
itself cuts every input to its `max_input_tokens`. Predictions are values
(`common.protocol.LengthPrediction`: bucket, lower and upper token bounds) for the dispatcher and
the decode admission policies.
No torch import here: the predictor's kind brings it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from common.config import PREDICTOR_MODES, ConfigError
from common.errors import InvalidRequestError
from common.protocol import LengthPrediction
from length_predictor.base import (
    DEFAULT_MAX_INPUT_TOKENS,
    LengthPredictor,
    LoadOptions,
    load_predictor,
)


@dataclass(frozen=True)
class ServiceOptions:
    mode: str = "parallel"  # parallel: own thread beside the main model; sequential: in poll()
    cutting_limit: int = DEFAULT_MAX_INPUT_TOKENS  # longer prompts are predicted alone
    max_batch_size: int = 16  # prompts per predictor forward

    def __post_init__(self) -> None:
        if self.mode not in PREDICTOR_MODES:
            raise ConfigError(f"predictor mode must be one of {PREDICTOR_MODES}, got "
                              f"{self.mode!r}")
        if self.cutting_limit < 1 or self.max_batch_size < 1:
            raise ConfigError("cutting limit and predictor batch size must be >= 1")


@dataclass
class ServiceStats:
    num_predicted: int = 0
    num_batches: int = 0
    busy_seconds: float = 0.0  # time spent inside the predictor


class PredictorService:
    def __init__(self, predictor: LengthPredictor, options: ServiceOptions = ServiceOptions()
                 ) -> None:
        self.predictor = predictor
        self.options = options
        self.stats = ServiceStats()
        self._pending: OrderedDict[str, list[int]] = OrderedDict()
        self._results: dict[str, LengthPrediction] = {}
        self._in_flight: set[str] = set()
        self._discarded: set[str] = set()  # in flight when discarded: drop the result
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if options.mode == "parallel" and not predictor.uses_hidden_states:
            self._thread = threading.Thread(target=self._loop, name="length-predictor",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def from_directory(cls, directory: str | Path, options: ServiceOptions = ServiceOptions(),
                       load: LoadOptions | None = None) -> PredictorService:
        """Load a saved predictor (`splitserve predictor train --out DIR`) and serve it."""
        return cls(load_predictor(directory, load or LoadOptions()), options)

    @property
    def uses_hidden_states(self) -> bool:
        """True: call `from_hidden` with the prefill forward's hidden states, not `submit`."""
        return self.predictor.uses_hidden_states

    # -- token-reading kinds -------------------------------------------------------------------
    def submit(self, seq_id: str, prompt_token_ids: list[int]) -> None:
        """Queue one prompt (target-model token ids) for prediction."""
        if self.uses_hidden_states:
            raise InvalidRequestError(f"a {self.predictor.kind} predictor reads hidden states: "
                                      f"use from_hidden(output.hidden)")
        if not prompt_token_ids:
            raise InvalidRequestError("cannot predict the length of an empty prompt")
        with self._cond:
            self._raise_error()
            self._discarded.discard(seq_id)
            self._pending[seq_id] = list(prompt_token_ids)
            self._cond.notify_all()

    def poll(self) -> dict[str, LengthPrediction]:
        """Every prediction finished since the last call (sequential mode: runs them first)."""
        if self._thread is None:
            self._drain()
        with self._cond:
            self._raise_error()
            done, self._results = self._results, {}
        return done

    def wait(self, seq_ids: Iterable[str], timeout: float | None = None
             ) -> dict[str, LengthPrediction]:
        """Block until these sequences are predicted (or `timeout` seconds); take their results."""
        wanted = set(seq_ids)
        if self._thread is None:
            self._drain()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._error and any(s in self._pending or s in self._in_flight
                                          for s in wanted):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            self._raise_error()
            return {s: self._results.pop(s) for s in wanted if s in self._results}

    def discard(self, seq_id: str) -> None:
        """Forget a sequence (aborted): pending work is dropped, a running result discarded."""
        with self._cond:
            self._pending.pop(seq_id, None)
            self._results.pop(seq_id, None)
            if seq_id in self._in_flight:
                self._discarded.add(seq_id)

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._in_flight)

    # -- hidden-state kinds --------------------------------------------------------------------
    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """What to ask the prefill forward for (`BatchPlan.hidden_layers`)."""
        return self.predictor.hidden_layers

    def from_hidden(self, hidden: Mapping[str, object]) -> dict[str, LengthPrediction]:
        """Predictions from `ModelOutput.hidden` of a forward planned with `hidden_layers`."""
        if not self.uses_hidden_states:
            raise InvalidRequestError(f"a {self.predictor.kind} predictor reads prompt tokens: "
                                      f"use submit()")
        if not hidden:
            return {}
        started = time.perf_counter()
        predictions = self.predictor.predict_hidden(list(hidden.values()))
        self._account(len(predictions), time.perf_counter() - started)
        return dict(zip(hidden.keys(), predictions))

    # -- the work ------------------------------------------------------------------------------
    def _take_batch(self) -> list[tuple[str, list[int]]]:
        """The oldest prompt, alone if over the cutting limit, else with the next short ones."""
        limit = self.options.cutting_limit
        first_id, first = next(iter(self._pending.items()))
        batch = [(first_id, first)]
        if len(first) <= limit:
            for seq_id, prompt in self._pending.items():
                if len(batch) == self.options.max_batch_size:
                    break
                if seq_id != first_id and len(prompt) <= limit:
                    batch.append((seq_id, prompt))
        for seq_id, _ in batch:
            del self._pending[seq_id]
            self._in_flight.add(seq_id)
        return batch

    def _predict(self, batch: list[tuple[str, list[int]]]) -> None:
        started = time.perf_counter()
        try:
            predictions = self.predictor.predict_tokens([prompt for _, prompt in batch])
        except Exception as exc:  # surfaced to the caller by poll()/wait()
            with self._cond:
                self._error = exc
                self._in_flight.clear()
                self._cond.notify_all()
            return
        self._account(len(batch), time.perf_counter() - started)
        with self._cond:
            for (seq_id, _), prediction in zip(batch, predictions):
                self._in_flight.discard(seq_id)
                if seq_id in self._discarded:
                    self._discarded.discard(seq_id)
                else:
                    self._results[seq_id] = prediction
            self._cond.notify_all()

    def _account(self, num: int, seconds: float) -> None:
        self.stats.num_predicted += num
        self.stats.num_batches += 1
        self.stats.busy_seconds += seconds

    def _drain(self) -> None:
        """Sequential mode: predict everything pending now, in the caller's thread."""
        while True:
            with self._cond:
                if not self._pending or self._error:
                    return
                batch = self._take_batch()
            self._predict(batch)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._take_batch()
            self._predict(batch)
            if self._error:
                return

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"length predictor failed: {self._error}") from self._error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PredictorService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
