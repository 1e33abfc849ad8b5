"""PredictorService: parallel and sequential modes, cutting-limit batching, the probe path."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from common.config import ConfigError
from common.errors import InvalidRequestError
from common.protocol import LengthPrediction
from length_predictor.base import LengthPredictor, PredictorMeta
from length_predictor.probe import ProbeEnsemble, ProbeHead, ProbePredictor
from length_predictor.serving import PredictorService, ServiceOptions

META = PredictorMeta(kind="fake", granularity=100, max_output_tokens=400)


class LengthEcho(LengthPredictor):
    """Predicts bucket = prompt length % num_buckets and records each batch it saw."""

    kind = "fake"

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        super().__init__(META)
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()
        self.gate, self.fail = gate, fail

    def predict_buckets(self, prompts):
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise ValueError("boom")
        self.batches.append([len(p) for p in prompts])
        self.threads.add(threading.current_thread().name)
        return [len(p) % self.num_buckets for p in prompts]

    def save_weights(self, directory: Path) -> None:
        pass

    @classmethod
    def load_weights(cls, meta, directory, options):
        return cls()


def test_sequential_mode_predicts_in_poll_in_the_callers_thread():
    predictor = LengthEcho()
    with PredictorService(predictor, ServiceOptions(mode="sequential")) as service:
        service.submit("a", [1] * 3)
        service.submit("b", [1] * 7)
        assert predictor.batches == []  # nothing runs before the caller asks
        done = service.poll()
    assert done == {"a": LengthPrediction(3, 300, 400), "b": LengthPrediction(2, 200, 300)}
    assert predictor.threads == {threading.current_thread().name}
    assert service.stats.num_predicted == 2


def test_parallel_mode_runs_on_its_own_thread():
    predictor = LengthEcho()
    with PredictorService(predictor) as service:
        for i in range(5):
            service.submit(f"s{i}", [7] * (i + 1))
        done = service.wait([f"s{i}" for i in range(5)], timeout=10)
        assert {k: v.bucket for k, v in done.items()} == {f"s{i}": (i + 1) % 5 for i in range(5)}
        assert service.poll() == {}  # wait took them
    assert predictor.threads == {"length-predictor"}


def test_long_prompts_run_alone_and_batches_are_bounded():
    predictor = LengthEcho()
    options = ServiceOptions(mode="sequential", cutting_limit=10, max_batch_size=2)
    with PredictorService(predictor, options) as service:
        for i, n in enumerate([3, 50, 4, 5, 60]):
            service.submit(f"s{i}", [1] * n)
        assert len(service.poll()) == 5
    assert predictor.batches == [[3, 4], [50], [5], [60]]


def test_discarded_sequences_get_no_prediction():
    gate = threading.Event()
    predictor = LengthEcho(gate)
    with PredictorService(predictor, ServiceOptions(max_batch_size=1)) as service:
        service.submit("running", [1])
        service.submit("queued", [1, 2])
        service.discard("queued")
        service.discard("running")  # in flight: its result is dropped
        gate.set()
        assert service.wait(["running", "queued"], timeout=5) == {}
        assert service.num_pending == 0


def test_predictor_errors_surface_in_the_caller():
    with PredictorService(LengthEcho(fail=True)) as service:
        service.submit("a", [1])
        with pytest.raises(RuntimeError, match="length predictor failed: boom"):
            service.wait(["a"], timeout=5)


def test_probe_predicts_from_the_prefill_hidden_states_without_a_forward():
    head = ProbeHead(6, 5, 0)
    with torch.no_grad():
        head.net.weight.zero_()
        head.net.weight[:, 0] = torch.arange(5.0)  # feature 0 > 0 -> last bucket, < 0 -> first
    probe = ProbePredictor(PredictorMeta(kind="probe", granularity=100, max_output_tokens=400),
                           ProbeEnsemble((30,), [head], [0]))
    with PredictorService(probe) as service:
        assert service.uses_hidden_states and service.hidden_layers == (30,)
        hidden = {"x": torch.tensor([3.0, 0, 0, 0, 0, 0]), "y": torch.tensor([-3.0, 0, 0, 0, 0, 0])}
        done = service.from_hidden(hidden)
        assert done["x"] == LengthPrediction(4, 400, 400)
        assert done["y"] == LengthPrediction(0, 0, 100)
        assert service.from_hidden({}) == {}
        with pytest.raises(InvalidRequestError, match="use from_hidden"):
            service.submit("z", [1, 2])


def test_token_kinds_refuse_hidden_states_and_empty_prompts():
    with PredictorService(LengthEcho(), ServiceOptions(mode="sequential")) as service:
        with pytest.raises(InvalidRequestError, match="use submit"):
            service.from_hidden({"a": torch.zeros(3)})
        with pytest.raises(InvalidRequestError, match="empty prompt"):
            service.submit("a", [])


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="predictor mode"):
        ServiceOptions(mode="async")
    with pytest.raises(ConfigError):
        ServiceOptions(max_batch_size=0)


def test_service_with_a_tiny_random_classifier(tmp_path):
    """The real classifier kind behind the service, in both modes, gives the same buckets."""
    import transformers

    from length_predictor.classifier import ClassifierPredictor, TokenBridge, load_backbone

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    meta = PredictorMeta(kind="classifier", granularity=100, max_output_tokens=400,
                         max_input_tokens=16)
    model = load_backbone(tmp_path, meta.bucketing.num_buckets, 0)
    predictor = ClassifierPredictor(meta, model, TokenBridge(None, tmp_path))
    prompts = {f"s{i}": [3 + (7 * i + j) % 60 for j in range(5 + 9 * i)] for i in range(6)}
    expected = dict(zip(prompts, predictor.predict_tokens(list(prompts.values()))))
    for mode in ("parallel", "sequential"):
        with PredictorService(predictor, ServiceOptions(mode=mode, cutting_limit=30,
                                                        max_batch_size=4)) as service:
            for seq_id, prompt in prompts.items():
                service.submit(seq_id, prompt)
            assert service.wait(prompts, timeout=30) == expected


def test_service_loads_a_saved_predictor(tmp_path):
    heads = [ProbeHead(4, 3, 8), ProbeHead(4, 3, 8)]
    probe = ProbePredictor(PredictorMeta(kind="probe", granularity=200, max_output_tokens=512),
                           ProbeEnsemble((5, 9), heads, [0, 1]))
    probe.save(tmp_path)
    with PredictorService.from_directory(tmp_path) as service:
        assert service.uses_hidden_states and service.predictor.granularity == 200
        assert service.hidden_layers == (5, 9)
        hidden = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
        (prediction,) = service.from_hidden({"a": hidden}).values()
        assert prediction == probe.predict_hidden(hidden[None])[0]


def test_light_modules_do_not_import_torch():
    """The control plane's CLI imports `length_predictor.cli`; the prefill role `serving`."""
    import subprocess
    import sys

    code = ("import sys\nimport length_predictor.cli, length_predictor.serving, "
            "length_predictor.base, length_predictor.buckets\nprint('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_prefill_refuses_a_probe_trained_for_another_model(tmp_path):
    """A probe's layers and width must exist in the served model: checked when the prefill
    instance starts, not at its first forward."""
    from types import SimpleNamespace

    from common.config import PredictionConfig
    from prefill_instance.prediction import PrefillPredictor

    probe = ProbePredictor(PredictorMeta(kind="probe", granularity=200, max_output_tokens=512,
                                         target_model="big"),
                           ProbeEnsemble((15, 30), [ProbeHead(4, 3, 0)] * 2, [0, 1]))
    probe.save(tmp_path)
    attached = PrefillPredictor(PredictionConfig(predictor=str(tmp_path), mode="parallel"))
    try:
        attached.check_served_model(SimpleNamespace(num_layers=30, hidden_size=4))
        with pytest.raises(InvalidRequestError, match="served model has 2 layers of width 4"):
            attached.check_served_model(SimpleNamespace(num_layers=2, hidden_size=4))
        with pytest.raises(InvalidRequestError, match="width 4 .*trained for big"):
            attached.check_served_model(SimpleNamespace(num_layers=30, hidden_size=64))
    finally:
        attached.close()
