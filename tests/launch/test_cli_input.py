"""Bad input to `labkit run`, `export`, `export-metrics` and `runs`: exit 2 with a message that names the flag or the
file, before anything launches or is written (tests/launch/test_faults.py has the RunConfig fields' refusals). All
in-process, all refused before a launch: no process starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from labkit import cli


def _refused(argv: list[str], capsys) -> str:
    """`labkit <argv>`'s stderr, after asserting it exited 2 with one `error:` line and no traceback."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and re.search(r"^error: \S", err, re.MULTILINE), err
    return err


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """The run store the refused commands would write into: it must stay absent."""
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def test_run_out_under_a_file_or_unmakeable_is_refused_naming_out(tmp_path, store, capsys, monkeypatch):
    """`--out` under a file, at a file, or where no directory can be made: NotADirectoryError / FileNotFoundError
    tracebacks (exit 1) after admission, or "[Errno 17] File exists" naming no flag; now exit 2 naming --out, before
    admission is even asked."""
    from labkit.launch import admission

    def no_admission(*_args, **_kwargs):
        raise AssertionError("admission asked before --out was checked")

    monkeypatch.setattr(admission.Admission, "here", classmethod(no_admission))
    a_file = tmp_path / "summary.json"
    a_file.write_text("{}")
    cases = {str(a_file / "sub"): f"--out {a_file / 'sub'} cannot be made: {a_file} is a file, not a directory",
             str(a_file): f"--out {a_file} is a file, not a directory",
             "/proc/labkit-no-such/x": "--out /proc/labkit-no-such/x cannot be made: no directory can be created in",
             "": "--out is an empty path"}
    for out, message in cases.items():
        err = _refused(["run", "--example", "deepspeed", "--hidden", "16", "--steps", "3", "--out", out], capsys)
        assert f"error: out: {message}" in err, err
    assert a_file.read_text() == "{}" and not store.exists()



def test_run_refuses_a_labkit_warm_it_does_not_understand_before_admission(store, capsys, monkeypatch):
    """`LABKIT_WARM=false` launched warm (only "0" was cold); a value that is no yes or no is now refused naming the
    variable, before admission (which may wait for memory) is asked."""
    from labkit.launch import admission

    def no_admission(*_args, **_kwargs):
        raise AssertionError("admission asked before LABKIT_WARM was checked")

    monkeypatch.setattr(admission.Admission, "here", classmethod(no_admission))
    monkeypatch.setenv("LABKIT_WARM", "maybe")
    err = _refused(["run", "--example", "deepspeed", "--hidden", "16", "--steps", "3"], capsys)
    assert "error: LABKIT_WARM: must be 0 (cold launches; also false, no, off) or 1" in err and "'maybe'" in err, err
    assert not store.exists()

def test_run_refuses_flags_that_script_mode_ignores(tmp_path, store, capsys):
    """`--script` runs the learner's script, which builds its own model, data, batch and DeepSpeed config: labkit's
    --stage, --micro-batch, --precision, ... were accepted, recorded in config.json and had no effect."""
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    ignored = {"--stage": "2", "--micro-batch": "8", "--precision": "bf16", "--offload-optimizer": None,
               "--hidden": "64", "--lr": "0.1", "--example": "zero3", "--target-loss": "1.0",
               "--no-telemetry": None, "--device-memory-budget-bytes": "1000000"}
    for name, value in ignored.items():
        err = _refused(["run", "--script", str(script), name, *([value] if value else []), "--steps", "1"], capsys)
        field = name.removeprefix("--no-").removeprefix("--").replace("-", "_")
        assert f"error: {field}: {name}: script mode runs the learner's script" in err, err
        assert "flag would have no effect" in err, err
    err = _refused(["run", "--script", str(script), "--stage", "2", "--micro-batch", "8"], capsys)
    assert "--micro-batch, --stage: script mode" in err and "flags would have no effect" in err, err
    assert not store.exists()
    # What script mode does use is taken (the config only: nothing launched here).
    args = cli.build_parser().parse_args(["run", "--script", str(script), "--world-size", "2", "--steps", "7",
                                          "--threads-per-rank", "1", "--heartbeat-s", "30",
                                          "--startup-timeout-s", "60"])
    config = cli.config_from_args(args)
    assert (config.script, config.world_size, config.steps, config.threads_per_rank) == (str(script), 2, 7, 1)


@pytest.mark.parametrize("port", ["70000", "0", "-1"])
def test_export_refuses_a_master_port_outside_1_to_65535(port, tmp_path, capsys):
    """`export --master-port 70000` wrote MASTER_PORT=70000 into launch.json and .deepspeed_env, exit 0."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    out = tmp_path / "job"
    err = _refused(["export", "--example", "zero3", "--world-size", "1", "--hostfile", str(hostfile),
                    "--master-port", port, "--out", str(out)], capsys)
    assert f"error: master_port: --master-port must be a TCP port, 1-65535, got {port}" in err, err
    assert not out.exists()


def test_export_out_at_a_file_is_refused_naming_out(tmp_path, capsys):
    """"[Errno 17] File exists: '<path>'" named no flag."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    err = _refused(["export", "--example", "zero3", "--world-size", "1", "--hostfile", str(hostfile),
                    "--out", str(hostfile)], capsys)
    assert f"error: out: --out {hostfile} is a file, not a directory" in err, err


def _a_run(run_dir: Path) -> Path:
    """A run directory with one rank's records: what export-metrics reads."""
    run_dir.mkdir()
    (run_dir / "rank0.jsonl").write_text(json.dumps({"event": "step", "step": 1, "loss": 2.0}) + "\n")
    return run_dir


def test_export_metrics_refuses_what_is_not_a_run_and_outputs_at_files_leaving_nothing(tmp_path, capsys):
    """A folder that is not a run: FileNotFoundError traceback (exit 1), after the --csv dir was made, and left
    empty; --tensorboard at a file: NotADirectoryError from inside TensorBoard; --csv at a file: "[Errno 17]"."""
    from labkit.launch.export_metrics import to_csv

    (tmp_path / "empty").mkdir()
    a_file = tmp_path / "summary.json"
    a_file.write_text("{}")
    run = _a_run(tmp_path / "run")
    csv_out = tmp_path / "csv"
    cases = {
        (str(tmp_path / "empty"), "--csv", str(csv_out)):
            f"error: run: {tmp_path / 'empty'} is not a run directory: it holds no rank records",
        ("", "--csv", str(csv_out)): "error: run: the run directory is an empty path",
        (str(run), "--tensorboard", str(a_file)): f"error: tensorboard: --tensorboard {a_file} is a file",
        (str(run), "--csv", str(a_file)): f"error: csv: --csv {a_file} is a file",
        (str(run), "--csv", str(a_file / "sub")): f"error: csv: --csv {a_file / 'sub'} cannot be made: {a_file} is",
    }
    for (run_dir, flag, out), message in cases.items():
        assert message in _refused(["export-metrics", run_dir, flag, out], capsys)
    assert not csv_out.exists() and a_file.read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="holds no rank records"):  # the library: no output dir made either
        to_csv(tmp_path / "empty", csv_out)
    assert not csv_out.exists()
    assert cli.main(["export-metrics", str(run), "--csv", str(csv_out)]) == 0
    assert (csv_out / "rank0.csv").read_text().splitlines() == ["step,loss", "1,2.0"]


def test_runs_root_given_and_missing_or_a_file_is_refused(tmp_path, capsys, monkeypatch):
    """`runs --root <typo>` said "no runs yet", exit 0; the default root missing still does."""
    a_file = tmp_path / "summary.json"
    a_file.write_text("{}")
    for root, what in ((tmp_path / "nonexist", "does not exist"), (a_file, "is a file, not a run store"),
                       ("", "is an empty path")):
        err = _refused(["runs", "--root", str(root)], capsys)
        assert f"error: root: --root {str(root)!r} {what}" in err, err
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "no-runs-yet"))
    (tmp_path / "no-runs-yet").mkdir()
    assert cli.main(["runs"]) == 0
    assert "no runs yet" in capsys.readouterr().out


def test_runs_dir_variable_at_a_file_is_refused_naming_it_and_missing_holds_no_runs_yet(tmp_path, capsys,
                                                                                        monkeypatch):
    """`LABKIT_RUNS_DIR=<a file> labkit runs` said "no runs yet", exit 0: now refused naming the variable. A store
    not made yet (the variable set in a shell profile before the first run) holds no runs yet, as runs/ does."""
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "not-made-yet"))
    assert cli.main(["runs"]) == 0 and "no runs yet" in capsys.readouterr().out
    assert not (tmp_path / "not-made-yet").exists()
    a_file = tmp_path / "summary.json"
    a_file.write_text("{}")
    for root, message in ((a_file, f"LABKIT_RUNS_DIR {a_file} is a file, not a directory"),
                          (a_file / "sub", f"LABKIT_RUNS_DIR {a_file / 'sub'} cannot be made: {a_file} is a file")):
        monkeypatch.setenv("LABKIT_RUNS_DIR", str(root))
        err = _refused(["runs"], capsys)
        assert f"error: LABKIT_RUNS_DIR: {message}" in err, err
    assert a_file.read_text() == "{}"


def test_run_with_the_runs_dir_variable_at_a_file_or_unmakeable_is_refused_before_launching(tmp_path, capsys,
                                                                                            monkeypatch):
    """`LABKIT_RUNS_DIR=<a file> labkit run` failed with NotADirectoryError (.admission/vm.json) after 3.5 s, and
    `=/proc/nope` with FileNotFoundError: exit 2 naming the variable, nothing launched. Missing is fine (made)."""
    from labkit.launch import device_lease

    def no_launch(*_args, **_kwargs):
        raise AssertionError("devices leased: the run was launching")

    monkeypatch.setattr(device_lease, "take_free", no_launch)
    a_file = tmp_path / "afile"
    a_file.write_text("kept")
    cases = {str(a_file): f"LABKIT_RUNS_DIR {a_file} is a file, not a directory",
             str(a_file / "runs"): f"LABKIT_RUNS_DIR {a_file / 'runs'} cannot be made: {a_file} is a file",
             "/proc/labkit-no-such": "LABKIT_RUNS_DIR /proc/labkit-no-such cannot be made: no directory can be "
                                     "created in /proc"}
    for root, message in cases.items():
        monkeypatch.setenv("LABKIT_RUNS_DIR", root)
        err = _refused(["run", "--example", "deepspeed", "--hidden", "16", "--steps", "3"], capsys)
        assert f"error: LABKIT_RUNS_DIR: {message}" in err, err
    assert a_file.read_text() == "kept"
    from labkit.launch.store import default_root

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "new" / "runs"))  # missing: a run makes it
    assert default_root() == tmp_path / "new" / "runs" and not (tmp_path / "new").exists()


def test_runs_lists_a_run_whose_summary_or_config_is_a_json_list_as_unreadable(tmp_path, capsys):
    """One run dir whose summary.json or config.json is a JSON list broke the whole listing (AttributeError)."""
    from labkit.launch.history import recover_stale, runs

    config = {"example": "zero3", "stage": 3, "world_size": 1, "micro_batch": 32, "grad_accum": 1}
    for name, files in {"a-good": {"config.json": config, "summary.json": {**config, "status": "finished"}},
                        "b-list-summary": {"config.json": config, "summary.json": [1, 2]},
                        # status.json: a started run without a summary, which recover_stale would reopen
                        "c-list-config": {"config.json": ["zero3"], "status.json": {"status": "running"}}}.items():
        (tmp_path / name).mkdir()
        for file, value in files.items():
            (tmp_path / name / file).write_text(json.dumps(value))
    assert recover_stale(tmp_path) == []
    table = runs(tmp_path).set_index("run_id")
    assert table.loc["a-good", "status"] == "finished"
    assert table.loc["b-list-summary", "status"] == "unreadable"
    assert table.loc["b-list-summary", "cause"] == "summary.json is not a JSON object (a list)"
    assert table.loc["c-list-config", "cause"] == "config.json is not a JSON object (a list)"
    assert cli.main(["runs", "--root", str(tmp_path)]) == 0
    assert "summary.json is not a JSON object" in capsys.readouterr().out


def test_runs_lists_runs_whose_files_are_damaged_otherwise(tmp_path, capsys):
    """A binary config.json or summary.json (UnicodeDecodeError), a summary.json that is a directory, a config whose
    batch is null or a string (TypeError), a status.json that is a list or names no integer pid (AttributeError,
    TypeError): each broke the whole listing. Each is listed now, the good run beside them, and a damaged summary of
    a run whose supervisor died is not replaced by a "supervisor died" one."""
    from labkit.launch.history import recover_stale, runs
    from labkit.launch.supervisor import host_identity

    config = {"example": "zero3", "stage": 3, "world_size": 1, "micro_batch": 32, "grad_accum": 1}
    binary = b"\xff\xfe\x00junk"
    # Its supervisor died on this host: a pid above Linux's largest (2**22) is no process's.
    lost = {"status": "running", "supervisor_pid": 2**22 + 1, "host": host_identity()}
    cases = {"a-good": {"config.json": config, "summary.json": {**config, "status": "finished"}},
             "b-binary-config": {"config.json": binary},
             "c-binary-summary": {"config.json": config, "summary.json": binary, "status.json": lost},
             "d-summary-directory": {"config.json": config, "summary.json": None, "status.json": lost},
             "e-null-batch": {"config.json": {**config, "micro_batch": None}, "status.json": {"status": "running"}},
             "f-string-batch": {"config.json": {**config, "micro_batch": "4"}},
             "g-list-status": {"config.json": config, "status.json": [1]},
             "h-string-pid": {"config.json": config, "status.json": {"supervisor_pid": "abc"}}}
    for name, files in cases.items():
        (tmp_path / name).mkdir()
        for file, value in files.items():
            path = tmp_path / name / file
            if value is None:
                path.mkdir()
            elif isinstance(value, bytes):
                path.write_bytes(value)
            else:
                path.write_text(json.dumps(value))
    assert recover_stale(tmp_path) == []
    assert (tmp_path / "c-binary-summary" / "summary.json").read_bytes() == binary  # kept as it was
    table = runs(tmp_path).set_index("run_id")
    assert list(table.index) == list(cases) and table.loc["a-good", "status"] == "finished"
    causes = {"b-binary-config": "config.json holds no JSON object", "c-binary-summary": "summary.json holds no JSON",
              "d-summary-directory": "summary.json does not read (Is a directory)"}
    for name, cause in causes.items():
        assert table.loc[name, "status"] == "unreadable" and table.loc[name, "cause"].startswith(cause)
    assert table.loc["g-list-status", "global_batch"] == 32 and pd.isna(table.loc["f-string-batch", "global_batch"])
    assert cli.main(["runs", "--root", str(tmp_path)]) == 0
    assert "h-string-pid" in capsys.readouterr().out


def test_arguments_after_a_double_dash_without_a_script_are_refused(capsys):
    """`labkit run --example zero3 -- --foo` dropped --foo without a word: they are a script's arguments."""
    assert cli.main(["run", "--example", "zero3", "--", "--foo"]) == 2
    assert ("error: script_args: the arguments after '--' (--foo) are a --script's, and no --script was given"
            in capsys.readouterr().err)


def test_answer_refuses_a_bad_variable_before_it_makes_its_directory(tmp_path, monkeypatch, capsys):
    """`labkit answer` made runs/answer-<profile>/ and announced its sweep before LABKIT_WARM=maybe was refused."""
    monkeypatch.setenv("LABKIT_WARM", "maybe")
    out = tmp_path / "answer"
    assert cli.main(["answer", "--profile", "smoke", "--out", str(out)]) == 2
    assert "error: LABKIT_WARM" in capsys.readouterr().err and not out.exists()
    monkeypatch.setenv("LABKIT_WARM", "1")
    monkeypatch.setenv("LABKIT_PROFILE", "smoke")
    assert cli.main(["answer", "--out", str(out)]) == 2
    assert ("smoke is `labkit answer`'s alone, the notebooks have no smoke size: unset LABKIT_PROFILE"
            in capsys.readouterr().err and not out.exists())


def test_run_and_export_refuse_the_variables_a_rank_would_fail_on(tmp_path, store, capsys, monkeypatch):
    """`LABKIT_FAULT=bogus` and `TORCH_EXTENSIONS_DIR` at a file launched and failed in the rank after 17-19 s;
    `export` copied bad LABKIT_* values into the job's .deepspeed_env with exit 0. Now refused before either, naming
    the variable (`labkit.launch.environment.check_environment`)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    job = tmp_path / "job"
    run = ["run", "--example", "deepspeed", "--hidden", "16", "--steps", "3"]
    export = ["export", "--example", "zero3", "--world-size", "1", "--hostfile", str(hostfile), "--out", str(job)]
    cases = {("LABKIT_FAULT", "bogus"): "error: LABKIT_FAULT: cannot parse 'bogus'",
             ("LABKIT_MEMORY_LIMIT_BYTES", "abc"): "error: LABKIT_MEMORY_LIMIT_BYTES: must be a number of bytes",
             ("LABKIT_EMULATED_DEVICES", "two"): "error: LABKIT_EMULATED_DEVICES: must be a positive integer",
             ("LABKIT_PROFILE", "bogus"): "error: LABKIT_PROFILE: must be one of"}
    for (name, value), message in cases.items():
        with monkeypatch.context() as patched:
            patched.setenv(name, value)
            for argv in (run, export):
                assert message in _refused(argv, capsys)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(a_file))
    err = _refused(run, capsys)
    assert f"error: TORCH_EXTENSIONS_DIR: TORCH_EXTENSIONS_DIR {a_file} is a file, not a directory" in err, err
    assert not store.exists() and not job.exists() and a_file.read_text() == "kept"
    # an exported job's directories are the cluster's: not checked on the login node
    from labkit.launch.environment import check_environment

    check_environment({"TORCH_EXTENSIONS_DIR": str(a_file)}, paths=False)
