"""The length predictor beside the prefill instance's main model (TetriInfer §3.3.2).

Each prefilled sequence gets a predicted output bucket (`seq.meta.prediction`, a
LengthPrediction) before it is dispatched, for the dispatcher's heavy/light split and the decode
instance's admission policy; `PredictionConfig` says where it comes from. Sources:
- a trained predictor directory (`splitserve predictor train`), served by the length predictor's
  `PredictorService`: a classifier reads the prompt's tokens, in parallel with the prefill on its
  own thread (or sequentially); a probe reads the main model's hidden state of the last prompt
  token from the prefill forward itself, at no extra forward;
- "oracle": max_tokens taken as the true length, bucketed (only meaningful for ignore-EOS
  workloads, where every request runs to max_tokens: the paper's ideal predictor).
Without a predictor configured every method here does nothing and sequences go unpredicted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from common.config import PredictionConfig
from common.plan import BatchPlan
from common.protocol import LengthPrediction
from common.sequence import Sequence

log = logging.getLogger(__name__)
WAIT_AT_DISPATCH_S = 0.05  # a late prediction is worth this much delay, not more


class PrefillPredictor:
    def __init__(self, config: PredictionConfig) -> None:
        self.oracle_granularity = config.oracle_granularity
        self.oracle = config.predictor == "oracle"
        self.service = None
        if config.predictor and not self.oracle:
            from length_predictor.serving import PredictorService, ServiceOptions

            self.service = PredictorService.from_directory(config.predictor,
                                                           ServiceOptions(mode=config.mode))
            log.info("length predictor %s loaded (%s)", config.predictor, config.mode)

    def check_served_model(self, shape) -> None:
        """Fail at start-up, not at the first forward, when the predictor cannot read the
        served model (a probe trained for another model)."""
        if self.service is not None:
            self.service.predictor.check_served_model(shape.num_layers, shape.hidden_size)

    @property
    def wants_hidden(self) -> bool:
        return self.service is not None and self.service.uses_hidden_states

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.service.hidden_layers if self.wants_hidden else ()

    def prepare(self, plan: BatchPlan) -> BatchPlan:
        """The plan, asking for the hidden states the probe reads (of the last prompt token)."""
        if not self.wants_hidden or plan.is_empty:
            return plan
        return replace(plan, return_hidden=True, hidden_layers=self.hidden_layers)

    def admit(self, seq: Sequence) -> None:
        if self.oracle:
            width = self.oracle_granularity
            bucket = seq.sampling.max_tokens // width
            seq.meta.prediction = LengthPrediction(bucket, bucket * width, (bucket + 1) * width)
        elif self.service is not None and not self.wants_hidden:
            self.service.submit(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens])

    def absorb(self, hidden: dict, find: Callable[[str], Sequence | None]) -> None:
        """Attach every prediction that is ready, from this forward's hidden states (probe) or
        from the predictor's thread (classifier), to its sequence (`find` looks it up)."""
        if self.service is None:
            return
        ready = self.service.from_hidden(hidden) if self.wants_hidden else self.service.poll()
        for seq_id, prediction in ready.items():
            seq = find(seq_id)
            if seq is not None:
                seq.meta.prediction = prediction

    def ensure(self, seq: Sequence) -> None:
        """At dispatch: wait briefly for a prediction still being computed."""
        if self.service is None or self.wants_hidden or seq.meta.prediction is not None:
            return
        ready = self.service.wait([seq.seq_id], timeout=WAIT_AT_DISPATCH_S)
        if seq.seq_id in ready:
            seq.meta.prediction = ready[seq.seq_id]

    def discard(self, seq_id: str) -> None:
        if self.service is not None:
            self.service.discard(seq_id)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
