"""The done record (labkit.rank.done): the timed steps' figures, rank 0's peak FLOP/s, and the record's fields in
the order they are written."""

from __future__ import annotations

import json

import pytest

from labkit.core.schema import CENSUS_KEYS, MEMORY_KEYS, DoneRecord
from labkit.rank import done
from labkit.rank.done import TIMED_FROM_STEP, TimedSteps, done_fields, peak_flops
from labkit.rank.telemetry import RankTelemetry
from labkit.runtime.devices import GPU_PEAK_FLOPS


class Clock:
    """perf_counter as the test sets it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(done.time, "perf_counter", clock)
    return clock


def test_the_first_steps_are_not_timed(clock):
    timed = TimedSteps()
    for step in range(1, TIMED_FROM_STEP):
        timed.begin(step)
        clock.now += 5
        timed.end(step, telemetry_s=1.0, eval_s=1.0)
    assert timed.fields() == {}  # a run that ended before TIMED_FROM_STEP has no timed figures


def test_timed_s_runs_from_the_first_timed_step_to_now_less_the_evaluations(clock):
    timed = TimedSteps()
    for step in range(1, 6):  # steps 3, 4 and 5 timed, 2 s each, one of their evals 0.5 s
        timed.begin(step)
        clock.now += 2
        timed.end(step, telemetry_s=0.25, eval_s=0.5 if step == 4 else 0.0)
    clock.now += 1  # the device's queued work, waited for after the loop
    assert timed.fields() == {"timed_steps": 3, "timed_s": 6 + 1 - 0.5, "telemetry_s": 0.75, "eval_s": 0.5}


def test_a_known_gpu_gets_its_datasheet_peak_without_measuring():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", "cuda:0") == {
        "peak_flops": GPU_PEAK_FLOPS[("H100",)]["bf16"], "peak_flops_source": "datasheet"}


def test_another_device_gets_a_measured_matmul_peak():
    got = peak_flops("Some CPU", "fp32", "cpu")
    assert got["peak_flops"] > 0 and got["peak_flops_source"].startswith("measured 1024x1024 fp32 matmul")


def test_the_done_record_is_written_in_the_schemas_keys_and_order(tmp_path):
    census = dict.fromkeys(CENSUS_KEYS, 1000)
    memory = {"rss_bytes": 7, "peak_rss_bytes": 8}
    timed = {"timed_steps": 3, "timed_s": 1.5, "telemetry_s": 0.1, "eval_s": 0.2}
    fields = done_fields(steps=5, stopped_at_target=True, n_params=123, optimizer_impl="torch_adam", census=census,
                         peak={"peak_flops": 1e12, "peak_flops_source": "datasheet"}, timed=timed,
                         telemetry_thread_cpu_s=0.0123456789, fsyncs=2, memory=memory)
    assert list(fields) == ["steps", "stopped_at_target", "n_params", "optimizer_impl", *CENSUS_KEYS, "peak_flops",
                            "peak_flops_source", *timed, "telemetry_thread_cpu_s", "fsyncs", *memory]
    assert fields["telemetry_thread_cpu_s"] == 0.012346 and fields["steps"] == 5 and fields["stopped_at_target"]
    assert set(fields) <= set(DoneRecord.__annotations__) | set(CENSUS_KEYS) | set(MEMORY_KEYS)
    telemetry = RankTelemetry(tmp_path, 0)
    telemetry.event("done", **fields)
    telemetry.close()
    written = json.loads((tmp_path / "rank0.jsonl").read_text().splitlines()[-1])
    assert written["event"] == "done" and list(written)[-len(fields):] == list(fields)
