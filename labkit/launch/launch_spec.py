"""`LaunchSpec`: what a run's supervisor starts, as `launch.json` holds it.

`Run.start` (and `labkit export`) build DeepSpeed's runner command (`labkit.launch.launcher.build_command`) and
write it here once, with what the supervisor, `Run` and a job's start need to know of it as typed fields:
the launcher, the hostfile, the master's address and port, what each rank runs, the warm, spawned or cold launch.
They are read from those fields, never by parsing the command line back. launch.json is private (0600): `env`
may hold variables the caller passed (`Run(env=...)`), which may be tokens.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.core.files import read_json, write_json_atomic
from labkit.launch.launcher import SINGLE_NODE_HOSTFILE
from labkit.launch.multinode import LAUNCHERS
from labkit.launch.warm_launch import WarmSpec

LAUNCH_FILE = "launch.json"
LAUNCH_MODES = ("warm", "spawned", "cold")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One run's launch (the keys of launch.json)."""
    argv: list[str]  # DeepSpeed's runner command line, as the supervisor starts it (cold launches)
    env: dict[str, str]  # only the variables labkit and the caller set: the rest is inherited, never stored
    world_size: int  # ranks in all
    heartbeat_s: float  # a rank silent this long after its first step is hung
    startup_timeout_s: float  # the allowance before a rank's first step (process start, JIT op builds)
    # "warm": the zygote forks the supervisor and the ranks (labkit.launch.zygote); "spawned": the supervisor starts
    # each rank's guard itself, as launch.py would (GPU runs, labkit.launch.warm_launch); "cold": DeepSpeed's runner
    launch: str = "cold"
    launcher: str = "pdsh"  # DeepSpeed's multi-node launcher: pdsh, openmpi or slurm (pdsh on one node)
    hostfile: str | None = None  # multi-node: the hostfile the runner reads; None: one node
    master_addr: str = "127.0.0.1"  # where rank 0 listens
    master_port: int = 0  # its port; 0: `labkit export --launcher slurm` leaves it to the job's start
    num_gpus: int | None = None  # --num_gpus of a one-node run on CPU ranks; None: leased devices, or multi-node
    module: str = ""  # the module every rank runs (labkit.rank.guard, or labkit.rank.entry under mpirun and srun)
    module_args: list[str] = field(default_factory=list)  # its arguments: --run-dir RUN_DIR [--script PATH ...]

    def __post_init__(self) -> None:
        if self.launch not in LAUNCH_MODES:
            raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {self.launch!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")

    @classmethod
    def from_command(cls, argv: list[str], env: dict[str, str], *, world_size: int, heartbeat_s: float,
                     startup_timeout_s: float, launch: str = "cold") -> LaunchSpec:
        """The spec of a launch command (build_command's argv, multi-node: launcher_command's), read once here."""
        def value(option: str) -> str | None:
            return argv[argv.index(option) + 1] if option in argv[:-1] else None

        hostfile = value("--hostfile")
        at = argv.index("--module") if "--module" in argv[:-1] else None
        num_gpus = value("--num_gpus")
        return cls(argv=list(argv), env=dict(env), world_size=world_size, heartbeat_s=heartbeat_s,
                   startup_timeout_s=startup_timeout_s, launch=launch, launcher=value("--launcher") or "pdsh",
                   hostfile=None if hostfile in (None, SINGLE_NODE_HOSTFILE) else hostfile,
                   master_addr=value("--master_addr") or "127.0.0.1", master_port=int(value("--master_port") or 0),
                   num_gpus=None if num_gpus is None else int(num_gpus),
                   module="" if at is None else argv[at + 1], module_args=[] if at is None else argv[at + 2:])

    @property
    def multi_node(self) -> bool:
        return self.hostfile is not None

    @property
    def script(self) -> bool:
        """Script mode (labkit.rank.script): the guard runs the learner's script on every rank."""
        return "--script" in self.module_args

    def forked_launch(self) -> WarmSpec | None:
        """What the supervisor's own launcher starts the ranks with, for a warm or spawned launch; None for a cold
        one (DeepSpeed's runner)."""
        if self.launch == "cold":
            return None
        return WarmSpec(world_size=self.world_size, master_addr=self.master_addr, master_port=self.master_port,
                        worker_args=list(self.module_args))

    def replace(self, **changes: Any) -> LaunchSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchSpec:
        """A spec from launch.json. Files written before the typed fields (they hold argv, env, world_size,
        heartbeat_s, startup_timeout_s and maybe launch) get them from their command, as it was written."""
        known = {f.name for f in dataclasses.fields(cls)}
        base = cls.from_command(data["argv"], data["env"], world_size=data["world_size"],
                                heartbeat_s=data["heartbeat_s"], startup_timeout_s=data["startup_timeout_s"],
                                launch=data.get("launch", "cold"))
        return base.replace(**{k: v for k, v in data.items() if k in known})

    def write(self, directory: str | os.PathLike, *, private: bool = True) -> None:
        write_json_atomic(Path(directory) / LAUNCH_FILE, self.to_dict(), private=private)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> LaunchSpec | None:
        """The spec in `directory`'s launch.json; None when there is none (a run not started yet)."""
        data = read_json(Path(directory) / LAUNCH_FILE)
        return cls.from_dict(data) if isinstance(data, dict) else None
