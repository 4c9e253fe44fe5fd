"""build_command is pure: the same config gives the same argv and environment, with no process started."""

from __future__ import annotations

import sys
from pathlib import Path

from labkit.config import RunConfig
from labkit.launcher import build_command, command_text, free_port


def test_single_node_command_uses_deepspeed_launcher_on_loopback(tmp_path):
    config = RunConfig(example="zero3", world_size=2, micro_batch=32)
    argv, env = build_command(config, tmp_path, master_port=29517, base_env={"PATH": "/bin"}, cpu_count=8,
                              accelerator="cpu")
    assert argv[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    assert argv[argv.index("--num_gpus") + 1] == "2"
    assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"  # nothing listens beyond loopback
    assert argv[argv.index("--master_port") + 1] == "29517"
    assert argv[argv.index("--module") + 1] == "labkit.rank_guard"
    assert argv[-2:] == ["--run-dir", str(tmp_path.resolve())]
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores split between 2 CPU ranks
    assert env["DS_ACCELERATOR"] == "cpu"
    # This interpreter's scripts (its ninja) first, then the caller's PATH.
    assert env["PATH"].split(":") == [str(Path(sys.executable).parent), "/bin"]
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and "TORCH_EXTENSIONS_DIR" in env
    again = build_command(config, tmp_path, master_port=29517, base_env={"PATH": "/bin"}, cpu_count=8,
                          accelerator="cpu")
    assert again == (argv, env)


def test_gpu_command_leaves_threads_alone(tmp_path):
    config = RunConfig(example="offload", world_size=1, max_world_size=8)
    _, env = build_command(config, tmp_path, master_port=1234, base_env={}, accelerator="cuda")
    assert "OMP_NUM_THREADS" not in env and env["DS_ACCELERATOR"] == "cuda"


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


def test_free_ports_differ():
    assert len({free_port() for _ in range(5)}) > 1
