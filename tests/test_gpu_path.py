"""Issue 21: what a real GPU (and the GPU audit) found, checked on CPU with DeepSpeed's own code and stand-ins.

The arch list DeepSpeed cannot parse, CPU Adam without nvcc, one weight decay for every optimizer, and each
rank's share of the cores on GPU nodes.
"""

from __future__ import annotations

import pytest
import torch

from labkit.launch.config import RunConfig
from labkit.launch.launcher import build_command
from labkit.runtime import ops


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


def test_cpu_adam_is_a_cpp_extension_on_the_cuda_accelerator_and_runs_without_nvcc():
    """Issue 21 item 3: labkit ran torch's AdamW for ZeRO-Offload whenever nvcc was missing. DeepSpeed 0.19.8's
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
    from labkit.live.panel import status_line

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


@pytest.mark.parametrize("example,stage,impl", [("deepspeed", 0, "torch_adam"), ("zero3", 3, "torch_adam"),
                                                ("deepspeed", 2, "fused_adam"), ("offload", 2, "cpu_adam")])
def test_every_deepspeed_optimizer_uses_no_weight_decay(one_gloo_rank, example, stage, impl):
    """Issue 21 item 4: without FusedAdam DeepSpeed builds torch.optim.AdamW (runtime/engine.py:2382), whose
    default weight decay is 0.01, while FusedAdam, CPU Adam and the plain loop's torch.optim.Adam use 0."""
    from labkit.launch.trainers import DeepSpeedTrainer
    from labkit.models.mlp import SimpleModel

    config = RunConfig(example=example, stage=stage, world_size=1, micro_batch=8, hidden=32, steps=2)
    torch.manual_seed(0)
    model = SimpleModel(config.input_size, config.hidden, config.output_size, config.depth)
    trainer = DeepSpeedTrainer(model, config, ops.with_optimizer_impl(config.ds_config(), impl))
    basic = trainer.engine.basic_optimizer
    if impl == "torch_adam":
        assert isinstance(basic, torch.optim.AdamW)  # what the GPU without nvcc runs
    assert {group["weight_decay"] for group in basic.param_groups} == {0.0}


def test_gpu_ranks_get_their_share_of_the_cores(tmp_path):
    """Issue 21 item 6: OMP_NUM_THREADS was set for CPU ranks only: 8 GPU ranks each ran torch's pool and
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
