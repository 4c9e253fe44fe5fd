"""The worker's step never makes the host wait for the device when telemetry is on.

The real loop (`labkit.rank.step_loop.train_step` + `labkit.rank.step_clock.StepClock`, as the worker runs
them) trains a real model on CPU, with the plain trainer and with a real DeepSpeed engine
(`DeepSpeedTrainer`, ZeRO-3 and ZeRO-2 + optimizer offload, one gloo rank). The accelerator the clock
is given is DeepSpeed's CPU accelerator wrapped to play an asynchronous device: its events complete
only once the "device" has moved on (LAG events later), reading an incomplete event's time fails as
on CUDA, and every call that would block the host on a GPU is counted: `accelerator.synchronize()`
(the wrapper's and DeepSpeed's global accelerator's), `Event.synchronize()` and `.item()`/`float()`/
`.tolist()` of a tensor that is not host (pinned) memory, and a host-to-device copy that blocks (`Tensor.to` a
device without `non_blocking=True`, or from memory the accelerator did not pin). The step's data is made before
its clock starts (labkit.rank.batches, fetched by train_step): no gather or collation is timed.

Each counted call is charged to the module that made it (the calling frame). labkit's calls must be
zero per steady step. Calls DeepSpeed's engine or torch's optimizers make themselves are counted
apart and not asserted: a plain `deepspeed` script makes them too. (DeepSpeed keeps running on its
own CPU accelerator, a synchronized device, so it takes its synchronous code paths here; its GPU
paths are not exercised.)
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from labkit.core.config import RunConfig
from labkit.core.records import rank_file, read_records
from labkit.models.data import make_dataset
from labkit.models.mlp import SimpleModel
from labkit.rank.step_clock import StepClock
from labkit.rank.step_loop import train_step
from labkit.rank.telemetry import RankTelemetry
from labkit.rank.trainers import DeepSpeedTrainer, PlainTrainer

LAG = 4  # events recorded after an event before the "device" has completed it (about a step)


def caller_package(depth: int = 2) -> str:
    """The top package of the frame `depth` levels up: labkit, deepspeed, torch, ..."""
    return sys._getframe(depth).f_globals.get("__name__", "").split(".")[0]


class CountingAccelerator:
    """DeepSpeed's accelerator with the behaviour of an asynchronous device, counting blocking calls:
    labkit's in `blocking`, everyone else's in `foreign` (by package and call)."""

    def __init__(self, real):
        self.real = real
        self.blocking: list[str] = []
        self.foreign: collections.Counter[tuple[str, str]] = collections.Counter()
        self.recorded: list[HostEvent] = []
        self.completed_upto = -1  # index of the last event the host waited for
        self.host_buffers: set[int] = set()
        self.scalar_pins = 0
        outer = self

        class HostEvent:
            def __init__(self, enable_timing: bool = False):
                assert enable_timing
                self.time_s: float | None = None

            def record(self):
                import time

                self.time_s = time.perf_counter()
                outer.recorded.append(self)

            def query(self) -> bool:  # non-blocking, as cudaEventQuery; one stream: in order
                index = outer.recorded.index(self)
                return index < len(outer.recorded) - LAG or index <= outer.completed_upto

            def synchronize(self):
                outer.blocking.append("Event.synchronize")
                outer.completed_upto = max(outer.completed_upto, outer.recorded.index(self))

            def elapsed_time(self, end) -> float:
                if not (self.query() and end.query()):
                    raise RuntimeError("elapsed_time of an event the device has not completed")
                return (end.time_s - self.time_s) * 1000.0

        self.Event = HostEvent

    def is_synchronized_device(self) -> bool:
        return False

    def count(self, name: str, package: str) -> None:
        if package == "labkit":
            self.blocking.append(name)
        else:
            self.foreign[package, name] += 1

    def synchronize(self, device_index=None):
        self.count("synchronize", caller_package())

    def pin_memory(self, tensor):
        self.host_buffers.add(tensor.data_ptr())
        self.scalar_pins += tensor.dim() == 0  # the clock's loss buffers
        return tensor

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def counting(monkeypatch):
    real_accelerator = get_accelerator()
    accelerator = CountingAccelerator(real_accelerator)
    for name in ("item", "__float__", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(tensor, *args, _real=real, _name=name):
            # PyTorch's Adam reads its CPU step counters with .item(), as it does in a plain script
            # (on a GPU those counters stay host tensors: no wait); charged to torch, not labkit.
            if tensor.data_ptr() not in accelerator.host_buffers:
                accelerator.count(f"Tensor.{_name}", caller_package())
            return _real(tensor, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # DeepSpeed's global accelerator (the engine's, and anything calling get_accelerator()): it
    # stays the CPU one, so DeepSpeed runs as it does here, but its synchronize() is counted too.
    real_synchronize = real_accelerator.synchronize

    def synchronize(device_index=None):
        accelerator.count("synchronize", caller_package())
        return real_synchronize(device_index)

    monkeypatch.setattr(real_accelerator, "synchronize", synchronize)
    real_to = torch.Tensor.to

    def to(tensor, *args, **kwargs):
        # A copy to a device blocks the host unless it is non_blocking from pinned memory (CUDA copies from
        # pageable memory synchronously). Here the "device" is the CPU: the call is judged, not its effect.
        names_device = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)
        if names_device and not (kwargs.get("non_blocking") and tensor.data_ptr() in accelerator.host_buffers):
            accelerator.count("Tensor.to (a blocking host-to-device copy)", caller_package())
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return accelerator


def watched(data, clock):
    """`data`, noting for each micro-batch taken whether the clock was timing a step then."""
    taken_in_step: list[bool] = []

    def batches():
        for batch in data:
            taken_in_step.append(clock._current is not None)
            yield batch

    return batches(), taken_in_step


def worker_data(config, accelerator, device="cpu"):
    """The worker's data path: its sampler and labkit.rank.batches."""
    from labkit.models.data import make_sampler
    from labkit.rank.batches import device_batches

    dataset = make_dataset(512, config.input_size, config.output_size, 0)
    sampler, _ = make_sampler(dataset, distributed_sampler=True, world_size=1, rank=0, seed=0)
    return device_batches(dataset, sampler, config.micro_batch, torch.device(device), accelerator)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_steps_make_no_blocking_calls_outside_census_steps(counting, grad_accum):
    config = RunConfig(example="pytorch", world_size=1, micro_batch=8, grad_accum=grad_accum, hidden=32,
                       steps=12, census_every=5)
    torch.manual_seed(0)
    model = SimpleModel(config.input_size, config.hidden, config.output_size, config.depth)
    trainer = PlainTrainer(model, config, torch.device("cpu"))
    clock = StepClock(counting)
    data, taken_in_step = watched(worker_data(config, counting), clock)
    assert clock.device_events
    records, blocking_by_step = [], {}
    for step in range(1, config.steps + 1):
        before = len(counting.blocking)
        measure = step <= 2 or step % config.census_every == 0
        census, _, _ = train_step(trainer, data, clock, step=step, grad_accum=grad_accum, measure=measure)
        clock.end(step=step, **census)
        records += clock.ready()
        blocking_by_step[step] = counting.blocking[before:]
    steady = [s for s in blocking_by_step if not (s <= 2 or s % config.census_every == 0)]
    assert {s: blocking_by_step[s] for s in steady} == {s: [] for s in steady}
    # The figures arrive late, not never: every step but the last few is recorded during the run ...
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= config.steps - 2
    assert counting.scalar_pins <= 3  # pinned loss buffers are reused, not one per step
    # No micro-batch was made inside a timed step (the DataLoader collated there).
    assert len(taken_in_step) == config.steps * grad_accum and not any(taken_in_step)
    # ... and the rest after the loop, where waiting once is allowed.
    records += clock.ready(wait=True)
    assert [r["step"] for r in records] == list(range(1, config.steps + 1))
    for record in records:
        assert record["loss"] > 0 and record["step_time_s"] > 0
        assert 0 < record["forward_s"] + record["backward_s"] + record["optimizer_s"] <= record["step_time_s"]
    assert "param_bytes" in records[4] and "param_bytes" not in records[5]  # the census: sampled steps only


def test_loss_is_the_mean_over_micro_batches(counting):
    clock = StepClock(counting)
    clock.begin()
    for value in (1.0, 2.0, 4.5):
        clock.add_loss(torch.tensor(value))
        clock.mark("forward_s")
    clock.end(step=1)
    assert clock.ready() == []  # the device has not got there yet
    (record,) = clock.ready(wait=True)
    assert record["loss"] == pytest.approx(2.5) and record["step"] == 1
    assert counting.blocking == ["Event.synchronize"]  # the one wait, asked for


def test_on_a_synchronized_device_records_are_ready_at_once():
    clock = StepClock(get_accelerator())  # DeepSpeed's CPU accelerator: no events, exact host clock
    assert not clock.device_events
    clock.begin()
    clock.add_loss(torch.tensor(3.0))
    clock.mark("forward_s")
    clock.end(step=7)
    (record,) = clock.ready()
    assert record["step"] == 7 and record["loss"] == 3.0 and record["forward_s"] <= record["step_time_s"]


# The real worker (labkit.rank.worker, one rank of world size 1, real deepspeed.initialize on CPU) on
# DeepSpeed's CPU accelerator playing a device with its own allocator statistics: RESIDENT bytes stay
# allocated, deepspeed.initialize leaves a passing peak of TRANSIENT bytes (flattened buffers, a gathered
# copy), and reset_peak_memory_stats() brings the peak back to what is allocated, as torch.cuda does.
# Every call of interest and every record the rank writes is logged in order.
PEAK_WORKER = '''
import json, runpy, sys

import deepspeed
import deepspeed.accelerator

log_path, run_dir, TRANSIENT, RESIDENT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
calls = []


class PeakDevice:
    _name = "emulated"  # not "cpu": labkit reads device memory (telemetry.memory) and resets its peak

    def __init__(self, real):
        self.real = real
        self.peak = RESIDENT

    def memory_allocated(self, device_index=None):
        return RESIDENT

    def memory_reserved(self, device_index=None):
        return RESIDENT

    def max_memory_allocated(self, device_index=None):
        return self.peak

    def reset_peak_memory_stats(self, device_index=None):
        calls.append("reset_peak_memory_stats")
        self.peak = RESIDENT

    def __getattr__(self, name):
        return getattr(self.real, name)


device = PeakDevice(deepspeed.accelerator.get_accelerator())
deepspeed.accelerator.get_accelerator = lambda: device  # what labkit's worker and telemetry import
real_initialize = deepspeed.initialize


def initialize(*args, **kwargs):
    out = real_initialize(*args, **kwargs)
    device.peak = max(device.peak, TRANSIENT)
    calls.append("deepspeed.initialize")
    return out


deepspeed.initialize = initialize
import labkit.rank.telemetry
import labkit.runtime.devices

real_write = labkit.rank.telemetry.RankTelemetry._write


def write(self, record):
    calls.append("record " + record.get("event", "?"))
    real_write(self, record)


labkit.rank.telemetry.RankTelemetry._write = write
labkit.runtime.devices.rank_device_name = lambda accelerator, local_rank: "emulated"  # torch has no such device
sys.argv = ["labkit.rank.worker", "--run-dir", run_dir]
try:
    runpy.run_module("labkit.rank.worker", run_name="__main__", alter_sys=True)
finally:
    with open(log_path, "w") as handle:
        json.dump(calls, handle)
'''


@pytest.mark.slow
def test_the_ready_record_and_the_runs_device_peak_leave_out_initializes_transient(tmp_path):
    """The device's peak counter was reset only before the first step, so the ready record's
    device_peak_bytes, and with it the run's device peak, was deepspeed.initialize's transient."""
    import json
    import subprocess

    from labkit.core.files import write_json_atomic
    from labkit.launch.launcher import build_command, free_port
    from labkit.launch.summary import summarize

    transient, resident = 7 << 30, 5 << 20
    config = RunConfig(example="zero3", stage=2, world_size=1, micro_batch=8, hidden=32, steps=3,
                       dataset_size=256, census_every=100)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_json_atomic(run_dir / "config.json", config.to_dict())
    port = free_port()
    _, env = build_command(config, run_dir, master_port=port, accelerator="cpu")
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    log = tmp_path / "calls.json"
    worker = subprocess.run([sys.executable, "-c", PEAK_WORKER, str(log), str(run_dir), str(transient),
                             str(resident)], env=env, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stderr[-3000:]
    calls = json.loads(log.read_text())
    initialized, ready = calls.index("deepspeed.initialize"), calls.index("record ready")
    # Reset after initialize, before the ready record (and so before the first step's record) ...
    assert "reset_peak_memory_stats" in calls[initialized:ready], calls
    assert calls.index("record step") > ready
    # ... so every record's peak, and the run's, is what the run holds, not initialize's transient.
    records = [json.loads(line) for line in (run_dir / "rank0.jsonl").read_text().splitlines()]
    peaks = {r["event"]: r["device_peak_bytes"] for r in records if "device_peak_bytes" in r}
    assert peaks and set(peaks) >= {"ready", "step", "done"}
    assert set(peaks.values()) == {resident}, peaks
    summary = summarize(run_dir, config.to_dict(), status="finished", cause=None)
    assert summary["per_rank"]["0"]["device_peak_bytes"] == resident


@pytest.mark.slow
@pytest.mark.parametrize("example,grad_accum", [("zero3", 2), ("offload", 1)])
def test_deepspeed_steps_add_no_blocking_calls_outside_census_steps(counting, one_gloo_rank, tmp_path, example,
                                                                    grad_accum):
    """The worker's per-step path around a real DeepSpeed engine: train_step, the clock, the record
    (memory readings, the JSON line, DeepSpeed's monitors)."""
    from labkit.runtime import ops

    config = RunConfig(example=example, world_size=1, micro_batch=8, grad_accum=grad_accum, hidden=32,
                       steps=12, census_every=5)
    impl = ops.choose_optimizer_impl(example=example, optimizer=config.optimizer,
                                     offload=bool(config.offload_optimizer), accelerator=get_accelerator()._name,
                                     cuda_ops=False)
    torch.manual_seed(0)
    model = SimpleModel(config.input_size, config.hidden, config.output_size, config.depth)
    trainer = DeepSpeedTrainer(model, config, ops.with_optimizer_impl(config.ds_config(), impl))
    telemetry = RankTelemetry(tmp_path, 0)
    clock = StepClock(counting)
    data, taken_in_step = watched(worker_data(config, counting, trainer.device), clock)
    blocking_by_step, foreign_by_step = {}, {}
    written = []

    def write_ready(wait: bool = False) -> None:  # as the worker's write_ready
        for record in clock.ready(wait=wait):
            samples_per_s = config.global_batch / record["step_time_s"]
            telemetry.step(**record, samples_per_s=samples_per_s)
            trainer.write_monitor(record["step"], {**record, "samples_per_s": samples_per_s})
            written.append(record["step"])

    try:
        for step in range(1, config.steps + 1):
            before, foreign_before = len(counting.blocking), counting.foreign.copy()
            measure = step <= 2 or step % config.census_every == 0
            telemetry.begin_step()
            census, _, _ = train_step(trainer, data, clock, step=step, grad_accum=grad_accum, measure=measure)
            clock.end(step=step, lr=trainer.lr, **census, **telemetry.memory())
            write_ready()
            blocking_by_step[step] = counting.blocking[before:]
            foreign_by_step[step] = dict(counting.foreign - foreign_before)
        write_ready(wait=True)
    finally:
        telemetry.close()
    steady = [s for s in blocking_by_step if not (s <= 2 or s % config.census_every == 0)]
    assert {s: blocking_by_step[s] for s in steady} == {s: [] for s in steady}, foreign_by_step
    assert not any(taken_in_step)
    # What DeepSpeed and torch themselves did (not labkit's to remove), shown with -s.
    print(f"{example}: calls outside labkit per steady step: {foreign_by_step[steady[-1]]}")
    assert written == list(range(1, config.steps + 1))
    steps = [r for r in read_records(rank_file(tmp_path, 0)) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == written and all(r["loss"] > 0 for r in steps)
    assert "param_bytes" in steps[4] and "param_bytes" not in steps[5]  # the census: sampled steps only
