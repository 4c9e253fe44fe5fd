"""benchmarks/bench_launch.py's pure helpers: the phase table from a synthetic process tree and probe records,
and the probe itself on a real interpreter (no timing asserted: only which stamps it writes and that they add up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_launch as bl  # noqa: E402 -- a script's module, importable once its folder is on sys.path


def test_role_of_names_each_hop() -> None:
    py = "/venv/bin/python"
    assert bl.role_of([py, "-m", "labkit.launch.supervisor", "runs/x"]) == "supervisor"
    assert bl.role_of([py, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]) == "runner"
    assert bl.role_of([py, "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"]) == "launch.py"
    assert bl.role_of([py, "-u", "-m", "labkit.rank.guard", "--local_rank=0"]) == "rank guard"
    assert bl.role_of([py, "-u", "-m", "labkit.rank.worker", "--run-dir", "x"]) == "rank"
    assert bl.role_of([py, "-u", "train.py", "--local_rank=1"]) == "rank"
    assert bl.role_of([py, "train.py"]) == "rank"
    assert bl.role_of(["ninja", "-v"]) is None
    assert bl.role_of([py, "-c", "pass", "train.py"]) is None  # train.py as a later argument is not the script


def tree() -> list[dict]:
    """labkit's launch of 2 ranks: supervisor 10 -> runner 11 -> launch.py 12 -> guards 13 (rank 1), 14 (rank 0)
    -> workers 15 (rank 1), 16 (rank 0)."""
    return [{"pid": 10, "ppid": 1, "create": 100.0, "role": "supervisor", "rank": None},
            {"pid": 11, "ppid": 10, "create": 100.5, "role": "runner", "rank": None},
            {"pid": 12, "ppid": 11, "create": 102.0, "role": "launch.py", "rank": None},
            {"pid": 13, "ppid": 12, "create": 103.4, "role": "rank guard", "rank": 1},
            {"pid": 14, "ppid": 12, "create": 103.5, "role": "rank guard", "rank": 0},
            {"pid": 15, "ppid": 13, "create": 103.6, "role": "rank", "rank": 1},
            {"pid": 16, "ppid": 14, "create": 103.7, "role": "rank", "rank": 0}]


def test_rank0_chain_follows_parents_to_rank_0() -> None:
    chain = bl.rank0_chain(tree(), bl.CHAINS["labkit"])
    assert [p["pid"] for p in chain] == [10, 11, 12, 14, 16]


def test_rank0_chain_marks_a_missing_hop_and_goes_on() -> None:
    procs = [p for p in tree() if p["role"] != "launch.py"]
    chain = bl.rank0_chain(procs, bl.CHAINS["labkit"])
    assert chain[2] is None
    assert [p["pid"] for p in chain if p] == [10, 11, 14, 16]


def test_exclusive_times_go_to_the_innermost_interval_and_add_up() -> None:
    intervals = [("import labkit", 1.0, 5.0), ("import torch", 2.0, 4.0), ("import deepspeed", 3.0, 3.5),
                 ("rendezvous", 9.0, 20.0)]  # past the segment's end: clipped
    out = bl.exclusive_times(0.0, 10.0, intervals)
    assert out == pytest.approx({bl.OTHER: 1.0 + 4.0, "import labkit": 2.0, "import torch": 1.5,
                                 "import deepspeed": 0.5, "rendezvous": 1.0})
    assert sum(out.values()) == pytest.approx(10.0)


def test_probe_intervals_from_records() -> None:
    events = [{"event": "up", "begin": 100.05}, {"event": "import", "name": "torch", "begin": 100.06, "end": 101.0},
              {"event": "import", "name": "deepspeed.launcher", "begin": 101.0, "end": 101.5},
              {"event": "op_load", "name": "fused_adam", "begin": 102.0, "end": 102.2},
              {"event": "forward1", "begin": 103.0}, {"event": "step1", "begin": 103.4}]
    assert bl.probe_intervals(events, created=100.0) == [
        ("interpreter start", 100.0, 100.05), ("import torch", 100.06, 101.0), ("import deepspeed", 101.0, 101.5),
        ("op loads", 102.0, 102.2), ("first step (forward -> optimizer step)", 103.0, 103.4)]


def test_phase_rows_tile_the_launch_and_the_table_compares_sides() -> None:
    probes = {10: [{"event": "up", "begin": 100.1},
                   {"event": "import", "name": "labkit", "begin": 100.1, "end": 100.3}],
              11: [{"event": "up", "begin": 100.6}, {"event": "import", "name": "deepspeed", "begin": 100.6,
                                                      "end": 101.8}],
              # launch.py (12) left no probe record: its whole hop is one row, and the run says so
              14: [{"event": "up", "begin": 103.55}],
              16: [{"event": "up", "begin": 103.8}, {"event": "import", "name": "torch", "begin": 103.8, "end": 104.5},
                   {"event": "rendezvous", "begin": 105.0, "end": 105.5},
                   {"event": "op_load", "name": "deepspeed_shm_comm", "begin": 105.1, "end": 105.3},
                   {"event": "initialize", "begin": 105.6, "end": 106.0},
                   {"event": "forward1", "begin": 106.2}, {"event": "step1", "begin": 106.5}]}
    chain = bl.rank0_chain(tree(), bl.CHAINS["labkit"])
    run = bl.phase_rows(chain, bl.CHAINS["labkit"], probes, start=99.9, first_step=107.0)
    rows = run["rows"]
    assert run["end"] == 106.5  # the probe's first optimizer step, not the fallback (the record's time)
    assert sum(rows.values()) == pytest.approx(106.5 - 99.9)
    assert rows[("caller", "start -> first process forked")] == pytest.approx(0.1)
    assert rows[("supervisor", "interpreter start")] == pytest.approx(0.1)
    assert rows[("supervisor", bl.OTHER)] == pytest.approx(0.2)
    assert rows[("runner", "import deepspeed")] == pytest.approx(1.2)
    assert rows[("launch.py", bl.NOT_SPLIT)] == pytest.approx(1.5)
    assert run["missing"] == ["launch.py (no probe record)"]
    assert rows[("rank", "rendezvous")] == pytest.approx(0.3)
    assert rows[("rank", "op loads")] == pytest.approx(0.2)
    assert rows[("rank", "deepspeed.initialize")] == pytest.approx(0.4)
    assert rows[("rank", "first step (forward -> optimizer step)")] == pytest.approx(0.3)

    bare_chain = bl.rank0_chain([{**p, "role": "rank" if p["pid"] == 14 else p["role"]} for p in tree()
                                 if p["pid"] in (11, 12, 14)], bl.CHAINS["bare-deepspeed"])
    bare = bl.phase_rows(bare_chain, bl.CHAINS["bare-deepspeed"], {14: [{"event": "up", "begin": 103.6},
                                                                         {"event": "step1", "begin": 105.0}]},
                         start=100.45, first_step=None)
    assert bare["end"] == 105.0 and bare["missing"] == ["runner (no probe record)", "launch.py (no probe record)"]
    table = bl.phase_table({"labkit": [run, run], "bare-deepspeed": [bare]})
    by_key = {(r["role"], r["phase"]): r for r in table}
    assert [r["role"] for r in table] == sorted((r["role"] for r in table), key=bl.ROLE_ORDER.index)
    supervisor = by_key[("supervisor", "interpreter start")]
    assert supervisor["labkit"] == pytest.approx(0.1) and supervisor["bare-deepspeed"] is None  # no such hop
    assert by_key[("runner", "import deepspeed")]["bare-deepspeed"] == "n/m"  # the hop ran, unmeasured
    assert by_key[("rank", "interpreter start")]["bare-deepspeed"] == pytest.approx(0.1)
    assert by_key[("rank", "interpreter start")]["labkit_n"] == 2
    assert by_key[("rank", "rendezvous")]["bare-deepspeed"] is None  # its rank was measured: it has none
    assert by_key[("launch.py", bl.NOT_SPLIT)]["bare-deepspeed"] == pytest.approx(1.5)  # no probe: the whole hop
    # A run whose hop was measured without a phase counts 0 s for it (an op already loaded, say).
    no_ops = {**run, "rows": {k: v for k, v in rows.items() if k != ("rank", "op loads")}}
    ops = {(r["role"], r["phase"]): r for r in bl.phase_table({"labkit": [run, no_ops]})}[("rank", "op loads")]
    assert ops["labkit"] == pytest.approx(0.1) and ops["labkit_n"] == 2
    kinds = bl.by_kind(run)
    assert kinds["interpreter start"] == pytest.approx(0.1 + 0.1 + 0.05 + 0.1)
    assert sum(kinds.values()) == pytest.approx(106.5 - 99.9)


def test_phase_rows_without_a_first_step_measure_nothing() -> None:
    run = bl.phase_rows([None], ("rank",), {}, start=0.0, first_step=None)
    assert run["rows"] == {} and run["missing"] == ["rank"]


@pytest.mark.slow
def test_the_probe_stamps_a_real_interpreter(tmp_path: Path) -> None:
    """A real interpreter with the probe on: up, torch's import, the first forward and optimizer step; off
    without the variable."""
    script = ("import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "m(torch.ones(1, 2)).sum().backward()\nopt.step()\nopt.step()\n")
    env = {**os.environ, "PYTHONPATH": str(bl.PROBE_PATH), bl.PROBE_DIR_ENV: str(tmp_path), "RANK": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    probes = bl.read_probes(tmp_path)
    assert len(probes) == 1
    events = next(iter(probes.values()))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "up" and kinds.count("forward1") == 1 and kinds.count("step1") == 1  # hooks fire once
    assert all(e["rank"] == 0 for e in events)
    torch_import = next(e for e in events if e["event"] == "import" and e["name"] == "torch")
    assert events[0]["begin"] <= torch_import["begin"] < torch_import["end"]
    env.pop(bl.PROBE_DIR_ENV)  # the probe on PYTHONPATH, its variable unset: it writes nothing
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True, timeout=300)
    assert len(list(tmp_path.glob("*.jsonl"))) == 1


def test_side_interpreters_are_the_probed_processes_off_the_hops() -> None:
    py = "/venv/bin/python"
    probes = {16: [{"event": "up", "begin": 1.0, "argv": [py, "-u", "-m", "labkit.rank.worker"]}],
              40: [{"event": "up", "begin": 2.0, "argv": [py, "/venv/lib/cpuinfo/cpuinfo.py", "--json"]}],
              41: [{"event": "up", "begin": 2.5, "argv": [py, "/venv/lib/cpuinfo/cpuinfo.py", "--json"]}],
              42: [{"event": "up", "begin": 3.0, "argv": [py, "-c", "import torch"]}],
              43: [{"event": "up", "begin": 3.0, "argv": [py, "-m", "pip", "list"]}],
              44: [{"event": "import", "name": "torch", "begin": 3.0, "end": 4.0}]}  # no up record: not counted
    assert bl.side_interpreters(probes, hop_pids={16}) == {"cpuinfo.py": 2, "-c": 1, "pip": 1}


def test_an_import_inside_a_call_is_named_with_it_and_sorted_after_it() -> None:
    intervals = [("deepspeed.initialize", 0.0, 4.0), ("op loads", 1.0, 2.0), ("import torch", 2.5, 3.5),
                 ("import torch", 5.0, 6.0)]
    out = bl.exclusive_times(0.0, 6.0, intervals)
    assert out == pytest.approx({"deepspeed.initialize": 2.0, "op loads": 1.0, bl.OTHER: 1.0, "import torch": 1.0,
                                 "import torch (inside deepspeed.initialize)": 1.0})
    phases = ["import torch (inside deepspeed.initialize)", bl.OTHER, "deepspeed.initialize", "import torch",
              "rendezvous"]
    assert sorted(phases, key=bl.phase_order) == ["import torch", "rendezvous", "deepspeed.initialize",
                                                   "import torch (inside deepspeed.initialize)", bl.OTHER]
