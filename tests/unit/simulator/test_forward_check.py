"""An instance's forward log and its check against the cost model (common/engine/forward_log.py,
simulator/forward_check.py): the shape a plan is priced by, the log's round trip and time
window, and the per-class table that splits mispricing from a different mix of forwards."""

from __future__ import annotations

import json

import pytest

from common.engine.forward_log import ForwardLog, read
from common.plan import BatchPlan, ForwardShape, ScheduledChunk
from common.sampling_params import SamplingParams
from simulator.calibrate import case_lines, run_logs
from simulator.costs import CostModel
from simulator.forward_check import classes, forward_class, forward_classes, totals

COSTS = CostModel(base=((1, 0.010), (64, 0.012), (512, 0.080)), per_sampled_row_s=0.001,
                  per_context_token_s=1e-5, per_context_pair_s=1e-7, kv_bytes_per_token=1024,
                  max_model_len=2048, per_mixed_forward_s=0.002, per_extra_prompt_s=0.003)


def chunk(seq: str, n: int, cached: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(seq, list(range(n)), cached, [0], SamplingParams() if sample else None)


def mixed_plan() -> BatchPlan:
    return BatchPlan([chunk("a", 1, 100), chunk("b", 1, 40), chunk("c", 30, 0),
                      chunk("d", 20, 0), chunk("e", 64, 128, sample=False)],
                     num_padding_tokens=2, swap_out=[(1, 2)])


def test_a_plans_shape_counts_what_its_cost_depends_on_and_prices_as_the_plan():
    shape = mixed_plan().shape()
    assert shape == ForwardShape(tokens=2 + 1 + 1 + 30 + 20 + 64, rows=4, context=268,
                                 pairs=100 + 40 + 128 * 64, fresh=(30, 20), decodes=2,
                                 prompts=3, swap_blocks=1)
    assert shape.kind == "mixed"
    assert COSTS.shape_s(shape) == COSTS.forward_s(mixed_plan())
    step = ForwardShape.decode_step(4, 300)
    assert step.kind == "decode" and COSTS.shape_s(step) == COSTS.decode_s(4, 300)
    assert BatchPlan([chunk("c", 30, 0)]).shape().kind == "prefill"


def test_the_forward_log_round_trips_and_cuts_to_a_window(tmp_path, monkeypatch):
    from common.engine import forward_log
    log = ForwardLog(str(tmp_path / "logs"), "coupled-0")
    for t in (100.0, 200.0, 300.0):
        monkeypatch.setattr(forward_log.time, "time", lambda t=t: t)
        log.record(mixed_plan(), 0.5, 0.6)
    log.close()
    lines = read(tmp_path / "logs" / "coupled-0.jsonl", 150.0, 300.0)
    assert [line["time"] for line in lines] == [200.0, 300.0]
    assert lines[0]["shape"] == mixed_plan().shape()
    assert (lines[0]["forward_s"], lines[0]["turn_s"]) == (0.5, 0.6)
    # the gap before each turn counts from the forward before it, in the window or not
    assert [line["gap_s"] for line in lines] == pytest.approx([100.0 - 0.6] * 2)
    assert read(tmp_path / "logs" / "coupled-0.jsonl")[0]["gap_s"] == float("inf")


@pytest.mark.parametrize("shape,name", [
    (ForwardShape.decode_step(1, 10), "decode b1"),
    (ForwardShape.decode_step(3, 10), "decode b2-3"),
    (ForwardShape.decode_step(40, 10), "decode b32+"),
    (BatchPlan([chunk("c", 33, 0)]).shape(), "prefill t33-128"),
    (BatchPlan([chunk("c", 600, 0)]).shape(), "prefill t513+"),
    (mixed_plan().shape(), "mixed t33-128"),
])
def test_forward_classes_group_decodes_by_batch_and_prompts_by_tokens(shape, name):
    assert forward_class(shape) == name


def test_the_table_sets_measured_seconds_against_the_model_and_the_simulated_mix():
    step = ForwardShape.decode_step(2, 50)
    real = [{"shape": step, "forward_s": 2 * COSTS.shape_s(step)} for _ in range(3)]
    real.append({"shape": mixed_plan().shape(), "forward_s": COSTS.shape_s(mixed_plan().shape())})
    simulated = [(step, COSTS.shape_s(step))] * 5
    table = classes(real, simulated, COSTS)
    assert list(table) == ["decode b2-3", "mixed t33-128"]  # decode first, then by size
    decode = table["decode b2-3"]
    assert decode["real_forwards"] == 3 and decode["simulated_forwards"] == 5
    assert decode["real_over_model"] == pytest.approx(2.0)  # measured twice the model
    assert table["mixed t33-128"]["real_over_model"] == pytest.approx(1.0)
    assert table["mixed t33-128"]["simulated_forwards"] == 0  # a class the simulation never ran
    total = totals(table)
    assert total["real_forwards"] == 4 and total["simulated_forwards"] == 5
    assert 1.0 < total["real_over_model"] < 2.0


def test_a_validation_case_reads_its_logs_within_the_load_window(tmp_path):
    directory = tmp_path / "case-forwards"
    directory.mkdir()
    step = ForwardShape.decode_step(1, 10)
    for name, times in (("coupled-0", (5.0, 15.0)), ("coupled-1", (16.0, 30.0))):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(
            {"time": t, "forward_s": 0.1, "turn_s": 0.2, **step.__dict__}) + "\n"
            for t in times))
    def lines(real):
        return case_lines(real, run_logs(real))
    result = forward_classes(lines({"forward_log": str(directory),
                                    "load_window": [10.0, 20.0]}), [], COSTS)
    assert result["all"]["real_forwards"] == 2  # 15.0 and 16.0, one from each instance
    assert forward_classes(lines({"forward_log": str(tmp_path / "gone"),
                                  "load_window": [0, 1]}), [], COSTS) is None
    assert forward_classes(lines({}), [], COSTS) is None  # recorded before the log


def test_the_forwards_calibration_measures_k_and_the_loop_work_from_the_log():
    """simulator.calibrate.from_forwards: nothing fitted to latencies; k is measured over
    modelled seconds at the logged shapes, the overhead the turns beyond their forwards."""
    from simulator.calibrate import from_forwards
    step, prompt = ForwardShape.decode_step(4, 400), BatchPlan([chunk("c", 200, 0)]).shape()
    lines = [{"shape": step, "forward_s": 1.5 * COSTS.shape_s(step),
              "turn_s": 1.5 * COSTS.shape_s(step) + 0.001},
             {"shape": prompt, "forward_s": 1.5 * COSTS.shape_s(prompt),
              "turn_s": 1.5 * COSTS.shape_s(prompt) + 0.003}]
    measured = from_forwards(lines, COSTS)
    assert measured["factor"] == pytest.approx(1.5)
    assert measured["turn_overhead_s"] == pytest.approx(0.002)
    assert measured["forwards"] == 2
    with pytest.raises(ValueError, match="no forward"):
        from_forwards([], COSTS)


def test_forwards_after_a_wait_for_work_measure_the_wake_up_not_k():
    """A forward the loop waited for ran longer than its shape's price (threads and caches
    waking up): that excess is `wake_s`, and k comes from the forwards that followed another."""
    from simulator.calibrate import from_forwards
    step, prompt = ForwardShape.decode_step(2, 100), BatchPlan([chunk("c", 40, 0)]).shape()
    busy = [{"shape": shape, "forward_s": 1.2 * COSTS.shape_s(shape), "turn_s": 1.0,
             "gap_s": 0.0001} for shape in (step, step, prompt)]
    woke = [{"shape": step, "forward_s": 1.2 * COSTS.shape_s(step) + 0.004, "turn_s": 1.0,
             "gap_s": 2.5},
            {"shape": prompt, "forward_s": 1.2 * COSTS.shape_s(prompt) + 0.008, "turn_s": 1.0,
             "gap_s": float("inf")}]  # an instance's first forward
    measured = from_forwards(busy + woke, COSTS)
    assert measured["factor"] == pytest.approx(1.2)
    assert measured["prompt_factor"] == pytest.approx(1.2)
    # per kind: a prefill instance's chunk wakes slower than a decode step
    assert measured["wake_s"] == pytest.approx(0.004) and measured["woke_forwards"] == 2
    assert measured["wake_prompt_s"] == pytest.approx(0.008)
    assert from_forwards(busy, COSTS)["wake_s"] == 0.0
    assert from_forwards(busy + woke[:1], COSTS)["wake_prompt_s"] == pytest.approx(0.004)
    only_woke = from_forwards(woke[:1], COSTS)  # no forward without a wait: k from all of them
    assert only_woke["factor"] == pytest.approx(1.2 + 0.004 / COSTS.shape_s(step))
    assert only_woke["wake_s"] == pytest.approx(0.0)


def test_the_request_path_is_the_probes_ttft_less_their_prompt_forwards():
    from simulator.request_path import latency
    prompt, step = BatchPlan([chunk("c", 12, 0)]).shape(), ForwardShape.decode_step(3, 90)
    lines = [{"time": t, "forward_s": s, "shape": prompt} for t, s in
             ((10.1, 0.020), (10.6, 0.030), (11.1, 0.022))]
    lines.append({"time": 10.3, "forward_s": 0.5, "shape": step})  # not a probe's forward
    lines.append({"time": 12.5, "forward_s": 0.9, "shape": prompt})  # after the probes
    probe = {"ttft_s": [0.031, 0.040, 0.029], "window": [10.0, 11.5]}
    assert latency(probe, lines) == pytest.approx(0.031 - 0.022)  # medians
    assert latency(None, lines) is None  # a run recorded before the probes
    assert latency({**probe, "ttft_s": [None, 0.04, 0.03]}, lines) is None  # a probe failed
    assert latency(probe, lines[3:]) is None  # no prompt forward in the window


def test_the_handoff_runs_from_a_prompts_last_chunk_to_its_sequences_first_step_alone():
    from simulator.calibrate import charges, path_charges
    from simulator.request_path import handoff

    def last(prompt, done=20):  # a prompt's last chunk: it samples the first token
        return BatchPlan([chunk("c", prompt - done, done)]).shape()

    def line(t, shape, turn=0.01, gap=5.0):
        return {"time": t, "forward_s": turn, "turn_s": turn, "gap_s": gap, "shape": shape}
    middle = BatchPlan([chunk("c", 20, 0, sample=False)]).shape()  # samples nothing
    # hand-offs of 0.01 + 0.0001 s per token: prompts 100, 300, 500
    logs = {"prefill-0": [line(10.0, middle), line(10.2, last(100)), line(11.0, last(300)),
                          line(12.0, last(500)), line(12.5, last(100)), line(19.99, last(250)),
                          line(30.0, last(500))],
            "decode-0": [line(10.23, ForwardShape.decode_step(1, 100)),  # began 10.22
                         line(11.05, ForwardShape.decode_step(1, 300)),  # began 11.04
                         line(12.07, ForwardShape.decode_step(1, 500)),  # began 12.06
                         # busy before, or two sequences: not a received sequence alone
                         line(12.54, ForwardShape.decode_step(1, 100), gap=0.0001),
                         line(12.60, ForwardShape.decode_step(2, 600)),
                         # another sequence reaching context 300 later, alone after a wait:
                         # not the first step at 300 after that prefill, so no hand-off
                         line(19.01, ForwardShape.decode_step(1, 300), gap=0.002),
                         # a busy instance takes the 250-token prompt on at the step that
                         # began 20.05 (the one before began 20.00): its KV came halfway
                         line(20.01, ForwardShape.decode_step(2, 400), gap=0.0001),
                         line(20.06, ForwardShape.decode_step(3, 400 + 2 + 250), gap=0.0001),
                         # later, another sequence alone at context 250 after a short wait: the
                         # instance ran forwards since that prefill, so it is no hand-off
                         line(25.01, ForwardShape.decode_step(1, 250), gap=0.002)]}
    fit = handoff(logs, (0.0, 20.0))
    assert fit["handoffs"] == 4
    assert fit["handoff_s"] == pytest.approx(0.01) and fit["handoff_per_token_s"] == \
        pytest.approx(0.0001)
    assert handoff(logs, (0.0, 11.5)) is None  # two pairs in the window: too few to read
    assert handoff({"coupled-0": logs["prefill-0"]}, (0.0, 20.0)) is None
    flat = {**logs, "decode-0": [line(t + 0.03, ForwardShape.decode_step(1, n))
                                 for t, n in ((10.2, 100), (11.0, 300), (12.0, 500))]}
    assert handoff(flat, (0.0, 20.0))["handoff_per_token_s"] == pytest.approx(0.0, abs=1e-12)
    real = {"load_window": [0.0, 20.0]}
    charged = charges(path_charges(real, logs))
    # no sharing of cores measured: each instance on its own (simulator/cores.py)
    assert (charged.pop("shared_cores"), charged.pop("core_threads")) == (None, 1)
    assert charged == pytest.approx({
        "turn_overhead_s": 0.0, "request_latency_s": 0.0, "wake_s": 0.0, "wake_prompt_s": 0.0,
        "handoff_s": 0.01, "handoff_per_token_s": 0.0001})
    # a calibration from before the wake-up per kind charges its one wake_s to both kinds
    assert charges({"handoff_s": None, "wake_s": 0.002}) == {
        "turn_overhead_s": 0.0, "request_latency_s": 0.0, "wake_s": 0.002,
        "wake_prompt_s": 0.002, "handoff_s": 0.0, "handoff_per_token_s": 0.0,
        "shared_cores": None, "core_threads": 1}


def test_a_falling_or_negative_handoff_fit_is_flat_or_through_the_origin():
    from simulator.request_path import _line_fit
    assert _line_fit([(100, 0.05), (200, 0.04), (300, 0.03)]) == pytest.approx((0.04, 0.0))
    a, b = _line_fit([(100, 0.001), (200, 0.012), (300, 0.023)])  # intercept -0.01
    assert a == 0.0 and b == pytest.approx(0.036 / 600)  # the mean seconds per token
    assert _line_fit([(100, 0.02)] * 3) == pytest.approx((0.02, 0.0))


def test_a_few_pairs_far_off_the_line_do_not_move_the_handoff_fit():
    from simulator.request_path import _line_fit
    line = [(n, 0.01 + 2e-5 * n) for n in range(100, 2000, 100)]
    assert _line_fit(line) == pytest.approx((0.01, 2e-5))
    assert _line_fit([*line, (1500, 9.0), (700, 4.0)]) == pytest.approx((0.01, 2e-5))


def test_the_handoff_line_carries_the_mean_of_a_tail_but_keeps_its_slope():
    """Reads that waited behind a prefill forward: a few hand-offs tens of milliseconds late.
    The simulator must add their mean (mean TPOT is a target); the slope stays the line's."""
    from simulator.request_path import _line_fit
    line = [(n, 0.01 + 2e-5 * n) for n in range(100, 2000, 100)]  # 19 on the line
    late = [(n, 0.01 + 2e-5 * n + 0.095) for n in (400, 1000, 1600)]  # 3 read 95 ms late
    a, b = _line_fit(line + late)
    assert b == pytest.approx(2e-5)
    assert a == pytest.approx(0.01 + 3 * 0.095 / 22)  # the mean, not the median (0.01)


def test_decode_steps_and_prompt_carrying_forwards_are_calibrated_apart():
    """A 1-thread prefill instance slowed more in service than the decode steps: k per kind."""
    from simulator.calibrate import from_forwards, scaled
    step, prompt = ForwardShape.decode_step(4, 400), BatchPlan([chunk("c", 200, 0)]).shape()
    mixed = mixed_plan().shape()
    lines = [{"shape": step, "forward_s": 0.9 * COSTS.shape_s(step), "turn_s": 1.0},
             {"shape": prompt, "forward_s": 1.3 * COSTS.shape_s(prompt), "turn_s": 1.0},
             {"shape": mixed, "forward_s": 1.3 * COSTS.shape_s(mixed), "turn_s": 1.0}]
    measured = from_forwards(lines, COSTS)
    assert measured["factor"] == pytest.approx(0.9)
    assert measured["prompt_factor"] == pytest.approx(1.3)
    calibrated = scaled(COSTS, measured)
    assert calibrated.shape_s(step) == pytest.approx(0.9 * COSTS.shape_s(step))
    assert calibrated.decode_s(4, 400) == pytest.approx(0.9 * COSTS.decode_s(4, 400))
    for shape in (prompt, BatchPlan([chunk("c", 30, 0), chunk("d", 20, 0)]).shape()):
        assert calibrated.shape_s(shape) == pytest.approx(1.3 * COSTS.shape_s(shape))
    assert calibrated.prefill_s(200) == pytest.approx(1.3 * COSTS.prefill_s(200))
    # the mixed forward's swap is a transfer, not a forward: only its compute scales
    assert mixed.swap_blocks == 1 and COSTS.swap_bytes_per_s is None
    assert calibrated.shape_s(mixed) == pytest.approx(1.3 * COSTS.shape_s(mixed))
    only_decodes = from_forwards(lines[:1], COSTS)  # a kind the log lacks takes the other's
    assert only_decodes["prompt_factor"] == pytest.approx(0.9)
    assert scaled(COSTS, {"factor": 1.2}).shape_s(prompt) == pytest.approx(
        1.2 * COSTS.shape_s(prompt))  # a latencies calibration: one k for everything


def test_a_per_row_in_service_cost_is_recovered_from_decode_steps():
    """Mode forwards-rows: measured = k x price + c x rows on decode steps; the calibrated model
    charges c on each sampled row."""
    from simulator.calibrate import from_forwards, per_row_fit, scaled
    steps = [ForwardShape.decode_step(b, 100 * b) for b in (1, 2, 3, 5, 8, 13)]
    lines = [{"shape": s, "forward_s": 1.1 * COSTS.shape_s(s) + 0.0012 * s.rows, "turn_s": 1.0}
             for s in steps]
    k, c = per_row_fit(lines, COSTS)
    assert (k, c) == (pytest.approx(1.1), pytest.approx(0.0012))
    calibration = from_forwards(lines, COSTS, per_row=True)
    model = scaled(COSTS, calibration)
    for s in steps:
        assert model.shape_s(s) == pytest.approx(1.1 * COSTS.shape_s(s) + 0.0012 * s.rows)
    faster_with_rows = [{**line, "forward_s": COSTS.shape_s(line["shape"]) * 1.2
                         - 0.0001 * line["shape"].rows} for line in lines]
    k, c = per_row_fit(faster_with_rows, COSTS)
    assert c == 0.0 and k > 0  # no negative per-row cost: the plain ratio instead


def test_each_side_reports_its_largest_prompt_only_forward():
    def prompt(n: int) -> ForwardShape:
        return ForwardShape.of(BatchPlan([chunk("p", n, 0)]))
    real = [{"time": 1.0, "forward_s": 0.1, "shape": s}
            for s in (prompt(192), prompt(40), ForwardShape.of(mixed_plan()))]
    simulated = [(prompt(64), 0.05), (prompt(64), 0.05), (ForwardShape.decode_step(3, 30), 0.01)]
    largest = forward_classes(real, simulated, COSTS)["largest_prefill_forward"]
    assert largest == {"real": 192, "simulated": 64}  # the mixed forward (116 tokens) is not one
