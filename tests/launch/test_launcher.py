"""build_command is pure: the same config gives the same argv and environment, with no process started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from labkit.core.config import RunConfig
from labkit.launch.launcher import build_command, command_text, free_port


def test_single_node_command_uses_deepspeed_launcher_on_loopback(tmp_path):
    config = RunConfig(example="zero3", world_size=2, micro_batch=32)
    argv, env = build_command(config, tmp_path, master_port=29517, base_env={"PATH": "/bin"}, cpu_count=8,
                              accelerator="cpu")
    assert argv[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    assert argv[argv.index("--num_gpus") + 1] == "2"
    assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"  # nothing listens beyond loopback
    assert argv[argv.index("--master_port") + 1] == "29517"
    assert argv[argv.index("--module") + 1] == "labkit.rank.guard"
    assert argv[-2:] == ["--run-dir", str(tmp_path.resolve())]
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores split between 2 CPU ranks
    assert env["DS_ACCELERATOR"] == "cpu"
    # This interpreter's scripts (its ninja) first, then the caller's PATH.
    assert env["PATH"].split(":") == [str(Path(sys.executable).parent), "/bin"]
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and "TORCH_EXTENSIONS_DIR" in env
    again = build_command(config, tmp_path, master_port=29517, base_env={"PATH": "/bin"}, cpu_count=8,
                          accelerator="cpu")
    assert again == (argv, env)


def test_gpu_command_gives_each_rank_its_share_of_the_cores(tmp_path):
    config = RunConfig(example="offload", world_size=1, max_world_size=8)
    _, env = build_command(config, tmp_path, master_port=1234, base_env={}, accelerator="cuda", cpu_count=16)
    assert env["OMP_NUM_THREADS"] == "16" and env["DS_ACCELERATOR"] == "cuda"


@pytest.mark.slow
def test_multi_node_command_uses_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-node-1 slots=8\ngpu-node-2 slots=8\n")
    config = RunConfig(example="zero3", world_size=16, hostfile=str(hostfile))
    argv, env = build_command(config, tmp_path / "run", master_port=29500, base_env={})
    assert "GLOO_SOCKET_IFNAME" not in env  # across nodes gloo must reach beyond loopback
    assert argv[argv.index("--hostfile") + 1] == str(hostfile)
    assert argv[argv.index("--master_addr") + 1] == "gpu-node-1"
    assert "--num_gpus" not in argv


def test_command_text_is_copy_pasteable(tmp_path):
    config = RunConfig(example="zero3", world_size=2)
    argv, env = build_command(config, tmp_path / "a b", master_port=29500, base_env={}, accelerator="cpu")
    text = command_text(argv, env, {})
    assert "DS_ACCELERATOR=cpu" in text and "'" in text  # the space in the path is quoted


def test_gpu_command_gives_the_ranks_exactly_the_leased_devices(tmp_path):
    """Not --num_gpus: with it DeepSpeed's runner ignores CUDA_VISIBLE_DEVICES and uses GPUs 0..N-1."""
    config = RunConfig(example="zero3", world_size=2, max_world_size=8)
    argv, env = build_command(config, tmp_path, master_port=29500, base_env={"CUDA_VISIBLE_DEVICES": "4,5,6"},
                              accelerator="cuda", device_ids=["5", "6"])
    assert "--num_gpus" not in argv and "--include" not in argv
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"
    with pytest.raises(ValueError, match="3 device ids for 2 ranks"):
        build_command(config, tmp_path, master_port=29500, base_env={}, accelerator="cuda",
                      device_ids=["0", "1", "2"])


def test_single_node_sockets_stay_on_loopback_whatever_the_caller_set(tmp_path):
    config = RunConfig(example="zero3", world_size=2)
    _, env = build_command(config, tmp_path, master_port=29500, accelerator="cuda", device_ids=["0", "1"],
                           base_env={"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"})
    # NCCL's bootstrap skips `lo` unless told; an inherited eth0 would open the run to the network.
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    import socket

    from labkit.launch.launcher import _ephemeral_range

    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high, port  # outgoing connections never take it meanwhile
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_last_exception_line_reads_only_the_last_traceback():
    from labkit.core.failures import last_exception_line

    log = ("ValueError: a warning printed and caught long ago\n"
           "step 7 ...\n")
    assert last_exception_line(log) is None  # no traceback: the exit code speaks instead
    log += ("Traceback (most recent call last):\n  File \"w.py\", line 3, in <module>\n"
            "RuntimeError: injected fault\n")
    assert last_exception_line(log) == "RuntimeError: injected fault"


@pytest.mark.slow
@pytest.mark.parametrize("accelerator, device_ids", [("cpu", None), ("cuda", ["0", "1"])])
def test_single_node_command_never_reads_the_clusters_default_hostfile(tmp_path, accelerator, device_ids):
    """Without --hostfile DeepSpeed's runner reads /job/hostfile, and where a cluster has
    one a single-node run became a pdsh multi-node launch that bypassed the device lease."""
    from deepspeed.launcher import runner

    from labkit.launch.launcher import is_multi_node

    config = RunConfig(example="zero3", world_size=2, max_world_size=8)
    argv, _ = build_command(config, tmp_path, master_port=29500, base_env={}, accelerator=accelerator,
                            device_ids=device_ids)
    args = runner.parse_args(argv[4:])  # what the runner makes of labkit's command line
    assert args.hostfile != runner.DLTS_HOSTFILE
    assert runner.fetch_hostfile(args.hostfile) is None  # the runner's local-resources path
    assert not is_multi_node(argv)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    multi, _ = build_command(RunConfig(example="zero3", world_size=2, hostfile=str(hostfile)), tmp_path,
                             master_port=29500, base_env={})
    assert is_multi_node(multi)
