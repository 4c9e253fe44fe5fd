"""labkit.launch.launch_spec: launch.json as a typed spec, read from the command once, written and read back."""

from __future__ import annotations

import json
import os

import pytest

from labkit.core.config import RunConfig
from labkit.launch.launch_spec import LaunchSpec
from labkit.launch.launcher import build_command
from labkit.launch.multinode import launcher_command
from labkit.launch.warm_launch import warm_spec

SMALL = dict(example="zero3", world_size=2, hidden=64, micro_batch=8, dataset_size=256, steps=5)
# What launch.json held before the typed fields: tools and tests read these keys.
KEYS = {"argv", "env", "world_size", "launch", "heartbeat_s", "startup_timeout_s"}


def spec_of(argv: list[str], launch: str = "cold") -> LaunchSpec:
    return LaunchSpec.from_command(argv, {"DS_ACCELERATOR": "cpu"}, world_size=2, heartbeat_s=30.0,
                                   startup_timeout_s=600.0, launch=launch)


def test_a_one_node_command_gives_typed_fields_and_a_warm_launch_equal_to_the_argv_one(tmp_path):
    argv, _ = build_command(RunConfig(**SMALL), tmp_path / "run", master_port=29600, base_env={})
    spec = spec_of(argv, "warm")
    assert (spec.launcher, spec.hostfile, spec.multi_node, spec.master_addr, spec.master_port, spec.num_gpus) == (
        "pdsh", None, False, "127.0.0.1", 29600, 2)
    assert (spec.module, spec.module_args, spec.script) == ("labkit.rank.guard",
                                                           ["--run-dir", str((tmp_path / "run").resolve())], False)
    assert spec.forked_launch() == warm_spec(argv)  # what the supervisor forks, without parsing argv again
    assert spec.replace(launch="cold").forked_launch() is None


def test_a_multi_node_and_a_script_command(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    config = RunConfig(**{**SMALL, "hostfile": str(hostfile)})
    argv, _ = build_command(config, tmp_path / "run", master_port=29600, base_env={}, master_addr="10.0.0.5")
    spec = spec_of(launcher_command(argv, "openmpi", tmp_path))
    assert (spec.launcher, spec.hostfile, spec.multi_node, spec.master_addr) == (
        "openmpi", str(hostfile.resolve()), True, "10.0.0.5")
    assert spec.module == "labkit.rank.entry" and spec.num_gpus is None
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    argv, _ = build_command(RunConfig(**{**SMALL, "script": str(script)}), tmp_path / "run", master_port=29600,
                            base_env={})
    assert spec_of(argv).script


def test_launch_json_round_trips_keeps_todays_keys_and_is_private(tmp_path):
    argv, _ = build_command(RunConfig(**SMALL), tmp_path / "run", master_port=29600, base_env={})
    spec = spec_of(argv, "warm")
    spec.write(tmp_path)
    data = json.loads((tmp_path / "launch.json").read_text())
    assert set(data) >= KEYS and data["launch"] == "warm" and data["argv"] == argv
    assert os.stat(tmp_path / "launch.json").st_mode & 0o077 == 0
    assert LaunchSpec.read(tmp_path) == spec
    assert LaunchSpec.read(tmp_path / "absent") is None


def test_a_launch_json_written_before_the_typed_fields_is_read_from_its_command(tmp_path):
    argv, _ = build_command(RunConfig(**SMALL), tmp_path / "run", master_port=29600, base_env={})
    old = {"argv": argv, "env": {}, "world_size": 2, "heartbeat_s": 30.0, "startup_timeout_s": 600.0}
    (tmp_path / "launch.json").write_text(json.dumps(old))  # no "launch" either: a cold launch
    spec = LaunchSpec.read(tmp_path)
    assert spec is not None and (spec.launch, spec.master_port, spec.module) == ("cold", 29600, "labkit.rank.guard")


def test_a_bad_launch_mode_is_refused():
    with pytest.raises(ValueError, match="launch must be one of"):
        spec_of([], "lukewarm")
