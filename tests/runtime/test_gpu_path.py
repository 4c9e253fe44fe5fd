"""What a real GPU (and the GPU audit) found, checked on CPU with DeepSpeed's own code and stand-ins.

The arch list DeepSpeed cannot parse, CPU Adam without nvcc, one weight decay for every optimizer, and each
rank's share of the cores on GPU nodes.
"""

from __future__ import annotations

import pytest
import torch

from labkit.core.config import RunConfig
from labkit.launch.launcher import build_command
from labkit.runtime import ops
from labkit.runtime.devices import Devices


def test_deepspeed_cannot_parse_an_arch_specific_list_and_labkits_list_passes(monkeypatch):
    """The H100 image sets TORCH_CUDA_ARCH_LIST with "9.0a": DeepSpeed 0.19.8's compute_capability_args
    (op_builder/builder.py:710) raised ValueError in `make ops` and in every rank loading FusedAdam."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    image_list = "8.0;9.0a"
    builder = FusedAdamBuilder()
    builder.jit_mode = True  # what a rank's builder.load() does: a JIT build
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", image_list)
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.compute_capability_args()  # DeepSpeed's own code, as on the H100
    fixed, note = ops.deepspeed_arch_list(image_list)
    assert fixed == "8.0;9.0" and note and "9.0a" in note
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", fixed)
    assert builder.compute_capability_args() == []  # JIT: parsed; torch takes the gencodes from the variable
    import os

    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"  # what DeepSpeed then hands torch

    # The ranks get the same list `make ops` built with: the op's JIT cache key includes its -gencode flags.
    config = RunConfig(example="zero3", world_size=1, max_world_size=8)
    _, env = build_command(config, "/tmp/run", master_port=1234, accelerator="cuda", device_ids=["0"],
                           base_env={"TORCH_CUDA_ARCH_LIST": image_list})
    assert env["TORCH_CUDA_ARCH_LIST"] == fixed
    _, env = build_command(config, "/tmp/run", master_port=1234, accelerator="cuda", device_ids=["0"],
                           base_env={"TORCH_CUDA_ARCH_LIST": "8.0;8.6+PTX"})
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;8.6+PTX"  # a parseable list is left as it is


@pytest.mark.parametrize("given,expected", [
    ("9.0a", "9.0"), ("10.0f;10.0", "10.0"), ("8.6 9.0a+PTX", "8.6;9.0+PTX"), ("7.5;8.0", "7.5;8.0"), ("", ""),
])
def test_arch_list_suffixes_are_stripped(given, expected):
    assert (ops.deepspeed_arch_list(given)[0] or "") == expected
    assert ops.deepspeed_arch_list(None) == (None, None)


@pytest.mark.slow
def test_cpu_adam_is_a_cpp_extension_on_the_cuda_accelerator_and_runs_without_nvcc():
    """labkit ran torch's AdamW for ZeRO-Offload whenever nvcc was missing. DeepSpeed 0.19.8's
    CUDA accelerator builds CPU Adam as a CppExtension (accelerator/cuda_accelerator.py:384-388): g++ only."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    cuda = CUDA_Accelerator()  # constructed on CPU: only its op-builder table is read
    cpu_adam = cuda.create_op_builder("CPUAdamBuilder")
    assert not isinstance(cpu_adam, CUDAOpBuilder)
    assert not any(source.endswith(".cu") for source in cpu_adam.builder().sources)
    assert any(source.endswith(".cu") for source in cuda.create_op_builder("FusedAdamBuilder").builder().sources)

    def impl(**kw):
        return ops.choose_optimizer_impl(example="offload", optimizer="adam", accelerator="cuda", **kw)

    assert impl(offload=True, cuda_ops=False, cpu_ops=True) == "cpu_adam"  # no nvcc: CPU Adam all the same
    assert impl(offload=True, cuda_ops=False, cpu_ops=False) == "torch_adam"  # no C++ compiler either
    assert impl(offload=False, cuda_ops=False) == "torch_adam"  # FusedAdam needs nvcc
    assert impl(offload=False, cuda_ops=True) == "fused_adam"


def test_finished_status_names_the_optimizer_that_ran():
    from labkit.ui.panel import status_line

    line = status_line("finished", steps=5, summary={"steps_completed": 5, "optimizer_impl": "cpu_adam"})
    assert "optimizer cpu_adam" in line


def test_optimizer_line_groups_runs_by_optimizer():
    from types import SimpleNamespace

    from labkit.study.lessons import optimizer_line

    runs = {"stage 0": SimpleNamespace(summary={"optimizer_impl": "fused_adam"}),
            "stage 2 + offload": SimpleNamespace(summary={"optimizer_impl": "cpu_adam"}),
            "stage 3 + offload": SimpleNamespace(summary={"optimizer_impl": "cpu_adam"})}
    assert optimizer_line(runs) == ("optimizer_impl: fused_adam (stage 0); "
                                    "cpu_adam (stage 2 + offload, stage 3 + offload)")


@pytest.mark.slow
@pytest.mark.parametrize("example,stage,impl", [("deepspeed", 0, "torch_adam"), ("zero3", 3, "torch_adam"),
                                                ("deepspeed", 2, "fused_adam"), ("offload", 2, "cpu_adam")])
def test_every_deepspeed_optimizer_uses_no_weight_decay(one_gloo_rank, example, stage, impl):
    """Without FusedAdam DeepSpeed builds torch.optim.AdamW (runtime/engine.py:2382), whose
    default weight decay is 0.01, while FusedAdam, CPU Adam and the plain loop's torch.optim.Adam use 0."""
    from labkit.models.mlp import SimpleModel
    from labkit.rank.trainers import DeepSpeedTrainer

    config = RunConfig(example=example, stage=stage, world_size=1, micro_batch=8, hidden=32, steps=2)
    torch.manual_seed(0)
    model = SimpleModel(config.input_size, config.hidden, config.output_size, config.depth)
    trainer = DeepSpeedTrainer(model, config, ops.with_optimizer_impl(config.ds_config(), impl))
    basic = trainer.engine.basic_optimizer
    if impl == "torch_adam":
        assert isinstance(basic, torch.optim.AdamW)  # what the GPU without nvcc runs
    assert {group["weight_decay"] for group in basic.param_groups} == {0.0}


def test_gpu_ranks_get_their_share_of_the_cores(tmp_path):
    """OMP_NUM_THREADS was set for CPU ranks only: 8 GPU ranks each ran torch's pool and
    CPU Adam's OpenMP threads on every core. Each rank now gets cores // ranks on the node."""
    config = RunConfig(example="offload", world_size=8, max_world_size=8)
    _, env = build_command(config, tmp_path, master_port=1234, base_env={}, accelerator="cuda", cpu_count=16,
                           device_ids=[str(i) for i in range(8)])
    assert env["OMP_NUM_THREADS"] == "2" and env["DS_ACCELERATOR"] == "cuda"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=4\nnode-b slots=2\n")
    multi = RunConfig(example="zero3", world_size=6, hostfile=str(hostfile))
    _, env = build_command(multi, tmp_path, master_port=1234, base_env={}, accelerator="cuda", cpu_count=16,
                           master_addr="10.0.0.1")
    assert env["OMP_NUM_THREADS"] == "4"  # the busiest node's 4 ranks share its 16 cores


# How torch reports an out-of-memory inside NCCL (torch/csrc/distributed/c10d/NCCLUtils: "NCCL error in: ...",
# ncclGetErrorWithVersion, then getNcclErrorDetailStr with NCCL's last error), raised in Python ...
NCCL_OOM_RAISED = """[rank0]: Traceback (most recent call last):
[rank0]:   File "labkit/rank/worker.py", line 301, in <module>
[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, \
unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.5
[rank0]: ncclUnhandledCudaError: Call to CUDA function failed.
[rank0]: Last error:
[rank0]: Cuda failure 2 'out of memory'
"""
# ... or from NCCL's watchdog thread, which aborts the process from C++ (SIGABRT, no Python traceback).
NCCL_OOM_WATCHDOG = """[rank0]:[E1124 07:31:02.000000000 ProcessGroupNCCL.cpp:1895] \
[PG ID 0 PG GUID 0(default_pg) Rank 0] \
Process group watchdog thread terminated with exception: CUDA error: out of memory
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: CUDA \
error: out of memory
"""
NCCL_CALLOC = """Traceback (most recent call last):
torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2046, unhandled system error
ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
Last error:
Failed to CUDA calloc 33554432 bytes
"""


@pytest.mark.parametrize("log,returncode", [(NCCL_OOM_RAISED, 1), (NCCL_OOM_WATCHDOG, -6), (NCCL_CALLOC, 1)])
def test_an_out_of_memory_inside_nccl_is_out_of_memory(log, returncode):
    """The supervisor read only the last 'SomeError: ...' line ("ncclUnhandledCudaError: Call to
    CUDA function failed.", or nothing after a watchdog abort) and called the run failed; a max-batch probe
    failing so stopped `labkit answer` before its report (labkit.study.sweep.settled)."""
    from labkit.core.failures import classify_exit
    from labkit.study.sweep import settled

    status, cause = classify_exit(log, returncode)
    assert status == "oom", cause
    assert "out of memory" in cause or "calloc" in cause
    assert settled(status, cause)


def test_other_failures_stay_failures():
    from labkit.core.failures import classify_exit

    earlier_warning = "warning: the last run ran out of memory\nTraceback (most recent call last):\nValueError: bad\n"
    assert classify_exit(earlier_warning, 1) == ("failed", "ValueError: bad")
    assert classify_exit("Segmentation fault\n", -11) == ("failed", "killed by SIGSEGV")


def test_stop_waits_long_enough_for_a_gpu_rank_to_free_its_memory():
    """Stop gave every rank 3 s after SIGTERM and 2 s after SIGKILL, and Run.stop 6 s in all: a
    CUDA context of tens of GB takes longer to tear down, and the run was reported with processes left."""
    from labkit.launch.run import stop_timeout_s
    from labkit.launch.supervisor import stop_timeouts

    assert stop_timeouts("cpu") == (3.0, 2.0)
    grace, kill_wait = stop_timeouts("cuda")
    assert grace >= 10 and kill_wait >= 20
    assert stop_timeout_s("cuda") > grace + kill_wait and stop_timeout_s("cpu") == 6.0


def _stand_in(count: int, bf16: bool, gib: int = 80) -> Devices:
    return Devices("cuda", count, count, "nccl", bf16, True, "NVIDIA H100 80GB HBM3", gib * 2**30)


def test_gpu_check_plans_every_stage_offload_and_a_real_oom_and_lists_what_one_gpu_cannot(monkeypatch):
    """On one GPU gpu-check said "2-rank runs: skipped" and still counted "failures: 2";
    it ran no ZeRO stage, no offload, no bf16 and no out-of-memory check."""
    from labkit.runtime import devices as devices_module
    from labkit.study.device_need import predicted_device_bytes
    from labkit.study.gpu_check import run_plan

    one = _stand_in(1, bf16=True)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: one)
    plan = run_plan(one, cuda_ops=False, cpu_ops=True)
    labels = [c.label for c in plan.checks]
    assert [c.fields.get("stage") for c in plan.checks[:4]] == [0, 1, 2, 3] and "bf16" in labels[0]
    assert {c.expect_impl for c in plan.checks[:4]} == {"torch_adam"}  # no nvcc: torch's Adam, said so
    offload = next(c for c in plan.checks if c.fields["example"] == "offload")
    assert offload.expect_impl == "cpu_adam"  # DeepSpeed's CPU Adam without nvcc
    oom = next(c for c in plan.checks if c.expect_status == "oom")
    config = RunConfig(**oom.fields)  # RunConfig takes it: a micro-batch past the dataset, sampled with replacement
    assert predicted_device_bytes(config) > one.total_memory_bytes  # a real out-of-memory, by the memory model
    assert len(plan.skipped) == 4 and all("needs 2 GPUs, 1 visible" in s for s in plan.skipped)
    for item in plan.checks:
        RunConfig(**item.fields)
    two = _stand_in(2, bf16=False, gib=16)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: two)
    plan = run_plan(two, cuda_ops=True, cpu_ops=True)
    assert not plan.skipped and sum(c.fields["world_size"] == 2 for c in plan.checks) == 4
    assert all(c.fields.get("precision") == "fp16" for c in plan.checks if "precision" in c.fields)  # a T4


def test_gpu_check_report_counts_skips_apart_from_failures(tmp_path):
    from labkit.study.gpu_check import _write_report

    _write_report(tmp_path / "r.txt", ["SKIPPED 2-rank ZeRO-0: needs 2 GPUs, 1 visible"], [], skipped=4)
    text = (tmp_path / "r.txt").read_text()
    assert "failures: none (4 check(s) skipped: not run on this machine, listed above)" in text


def test_an_unknown_gpus_peak_comes_from_a_large_matmul_timed_with_device_events():
    """A 1024 x 1024 matmul timed with the host clock around asynchronous work measured launch
    overhead. On a device (not synchronized) labkit now times an 8192 x 8192 product with its events."""
    import time
    from types import SimpleNamespace

    from labkit.runtime.devices import MATMUL_SIZE_GPU, measured_matmul_flops

    recorded = []

    class Event:  # a device event on the host: its time when recorded (CPU ops are synchronous)
        def __init__(self, enable_timing=False):
            assert enable_timing
            recorded.append(self)

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1000.0

    device = SimpleNamespace(is_synchronized_device=lambda: False, Event=Event)
    flops, how = measured_matmul_flops("cpu", "fp32", size=128, accelerator=device, seconds=0.05)
    assert flops > 0 and recorded and "events" in how and "128x128" in how
    assert MATMUL_SIZE_GPU >= 8192
    cpu = SimpleNamespace(is_synchronized_device=lambda: True)
    assert "1024x1024" in measured_matmul_flops("cpu", "fp32", accelerator=cpu, seconds=0.05)[1]


@pytest.mark.parametrize("name,count,slug", [("NVIDIA H100 80GB HBM3", 1, "h100-80gb"), ("Tesla T4", 4, "t4-x4"),
                                             ("NVIDIA A100-SXM4-80GB", 8, "a100-80gb-x8"),
                                             ("NVIDIA H100 NVL", 1, "h100-nvl"), ("NVIDIA A10G", 1, "a10g"),
                                             ("NVIDIA L4", 2, "l4-x2")])
def test_reference_directories_are_named_after_the_gpu(name, count, slug):
    from labkit.study.gpu_reference import gpu_slug

    assert gpu_slug(Devices("cuda", count, count, "nccl", True, True, name, 80 * 2**30)) == slug


@pytest.mark.slow
def test_reference_steps_are_resumable_and_separately_callable(tmp_path, monkeypatch):
    """Each step of the GPU reference run is its own command, recorded in steps.json; one that
    passed is skipped when called again (a device call cut off by its time limit is simply repeated)."""
    import json
    import sys

    from labkit.study import gpu_reference

    commands = gpu_reference.step_commands("answer", tmp_path)
    assert commands[0][-4:] == ["--out", str(gpu_reference.REPO / "runs" / "answer-workshop"), "--reference",
                                str(tmp_path)] and "--profile" in commands[0]
    assert "--nbval-lax" in gpu_reference.step_commands("notebooks", tmp_path)[0]
    assert "labkit.study.gpu_check" in gpu_reference.step_commands("check", tmp_path)[0]
    ran = []

    def fake(step, out, python=sys.executable):
        ran.append(step)
        return [[python, "-c", "import os, sys; sys.exit(0 if os.environ['LABKIT_PROFILE'] == 'workshop' else 3)"]]

    monkeypatch.setattr(gpu_reference, "step_commands", fake)
    assert gpu_reference.run_step("check", tmp_path)["status"] == "passed"
    assert gpu_reference.run_step("check", tmp_path)["status"] == "passed" and ran == ["check"]  # skipped
    gpu_reference.run_step("check", tmp_path, force=True)
    assert ran == ["check", "check"]
    monkeypatch.setattr(gpu_reference, "step_commands", lambda step, out: [[sys.executable, "-c", "exit(3)"]])
    # An answer that did not finish keeps what it measured: results.csv and each run's records, not its rank logs
    # nor its private files (the H200's answer was copied so by hand, data/reference-h200/answer-partial).
    answer_dir = tmp_path / "answer-workshop"
    run = answer_dir / "runs" / "20261130-144731-pytorch-torch-w1-b512-9c76"
    (run / "logs").mkdir(parents=True)
    for name in ("summary.json", "rank0.jsonl", "rank0.exit", "config.json", "command.txt", "launch.json",
                 "logs/20261130144731_rank0.log"):
        (run / name).write_text(name)
    (answer_dir / "results.csv").write_text("key,status\na,finished\n")
    monkeypatch.setattr(gpu_reference, "ANSWER_DIR", answer_dir)
    out = tmp_path / "reference"
    out.mkdir()
    record = gpu_reference.run_step("answer", out)
    assert record["status"] == "failed (exit 3)" and record["partial"] == "answer-partial"
    kept = out / "answer-partial"
    assert (kept / "results.csv").read_text() == "key,status\na,finished\n"
    assert sorted(f.name for f in (kept / "run-records" / run.name).iterdir()) == [
        "config.json", "rank0.exit", "rank0.jsonl", "summary.json"]
    assert json.loads((out / "steps.json").read_text())["answer"]["status"] == "failed (exit 3)"

    def interrupted(*_args, **_kwargs):  # a device call's `timeout -s INT`, or Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_reference, "run_command", interrupted)
    (answer_dir / "results.csv").write_text("key,status\na,finished\nb,finished\n")
    with pytest.raises(KeyboardInterrupt):
        gpu_reference.run_step("answer", out)
    assert (kept / "results.csv").read_text().count("finished") == 2  # replaced by the newer table
    assert json.loads((out / "steps.json").read_text())["answer"]["status"] == "interrupted"
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert steps["check"]["status"] == "passed"
    assert gpu_reference.reference_dir(Devices("cpu", 1, 2, "gloo", True, False, "CPU", 2**30)) is None


@pytest.mark.slow
def test_reference_notebooks_at_once_each_with_its_own_leases_and_the_boundary_notebook_alone(tmp_path, monkeypatch):
    """--jobs: the memory-boundary notebook runs first and alone, the others together (each waits until all three have
    started, so run one after another they would time out), each in its own process with its own lease directory
    (TMPDIR); a failing one is named in the step's status, and the step called again runs only that one."""
    import json
    import sys

    from labkit.study import gpu_reference

    script = """
import os, sys, time
name, out = sys.argv[1], os.environ["OUT"]
open(os.path.join(out, name + ".start"), "w").write(os.environ["TMPDIR"])
together = [] if name == "alone" else ["a", "b", "c"]
deadline = time.monotonic() + 60
while not all(os.path.exists(os.path.join(out, n + ".start")) for n in together):
    if time.monotonic() > deadline:
        sys.exit(4)  # the others never started beside it
    time.sleep(0.05)
if name == "alone" and any(os.path.exists(os.path.join(out, n + ".start")) for n in "abc"):
    sys.exit(5)  # another notebook started while the boundary notebook ran
with open(os.path.join(out, "ran"), "a") as ran:
    ran.write(name + "\\n")
sys.exit(3 if name == "b" and not os.path.exists(os.path.join(out, "fixed")) else 0)
"""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_reference, "NOTEBOOKS", ("a", "alone", "b", "c"))
    monkeypatch.setattr(gpu_reference, "ALONE", ("alone",))
    monkeypatch.setattr(gpu_reference, "notebook_command", lambda name, junit: [sys.executable, "-c", script, name])
    record = gpu_reference.run_step("notebooks", tmp_path, jobs=3)
    assert record["status"] == "failed (b)" and record["jobs"] == 3
    assert {n: r["status"] for n, r in record["notebooks"].items()} == {
        "alone": "passed", "a": "passed", "b": "failed (exit 3)", "c": "passed"}
    assert len({(tmp_path / f"{n}.start").read_text() for n in ("alone", "a", "b", "c")}) == 4  # a lease dir each
    assert json.loads((tmp_path / "steps.json").read_text())["notebooks"]["status"] == "failed (b)"
    (tmp_path / "fixed").touch()
    (tmp_path / "b.start").unlink()  # b runs again by itself: a's and c's start files stand as they left them
    (tmp_path / "ran").write_text("")
    for name in ("a", "c"):
        (tmp_path / f"{name}.start").touch()
    assert gpu_reference.run_step("notebooks", tmp_path, jobs=3)["status"] == "passed"
    assert (tmp_path / "ran").read_text().split() == ["b"]  # only the one that had failed ran again


@pytest.mark.parametrize("jobs", ["0", "-1", "abc"])
def test_reference_jobs_below_one_is_refused_not_taken_as_one(jobs, monkeypatch, capsys):
    """`make gpu-reference JOBS=0` ran one notebook at a time, silently."""
    from labkit.study import gpu_reference

    monkeypatch.setattr("sys.argv", ["gpu_reference", "notebooks", "--jobs", jobs])
    with pytest.raises(SystemExit) as exit_info:
        gpu_reference.main()
    assert exit_info.value.code == 2
    assert f"--jobs: must be a number of notebooks at once, 1 or more, got '{jobs}'" in capsys.readouterr().err
