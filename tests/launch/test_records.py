"""Watching a run costs O(1) per poll: the readers read only the bytes written since the last poll."""

from __future__ import annotations

import json

from labkit.core.config import RunConfig
from labkit.core.records import RecordTail, rank_file, read_records
from labkit.launch.run import Run


def _append(path, *records, tail: bytes = b"") -> None:
    with open(path, "ab") as handle:
        handle.write(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


def test_tail_reads_each_byte_once_and_waits_for_complete_lines(tmp_path):
    path = tmp_path / "rank0.jsonl"
    tail = RecordTail(path)
    assert tail.poll() == [] and tail.bytes_read == 0  # not written yet
    for step in range(1, 201):
        _append(path, {"event": "step", "step": step})
        size_before = tail.bytes_read
        assert tail.poll() == [{"event": "step", "step": step}]
        # Only the new line was read, however long the file has grown.
        assert tail.bytes_read - size_before == len(json.dumps({"event": "step", "step": step})) + 1
    _append(path, {"event": "step", "step": 201}, tail=b'{"event": "ste')  # a record half written
    assert tail.poll() == [{"event": "step", "step": 201}]
    _append(path, tail=b'p", "step": 202}\n')
    assert tail.poll() == [{"event": "step", "step": 202}]
    assert tail.bytes_read == path.stat().st_size
    assert tail.poll() == [] and tail.bytes_read == path.stat().st_size
    assert [r["step"] for r in read_records(path)] == list(range(1, 203))


def test_run_progress_reads_only_new_bytes(tmp_path, rank_file_reads):
    """The CLI's progress bar polls Run.progress() twice a second for the whole run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = RunConfig(example="pytorch", world_size=1, steps=1000)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    run = Run.load(run_dir)
    read = rank_file_reads.reads
    for step in range(1, 301):
        _append(rank_file(run_dir, 0), {"event": "step", "step": step, "loss": 1.0})
        assert run.progress() == step
    line = len(json.dumps({"event": "step", "step": 300, "loss": 1.0})) + 1
    assert max(read) <= line  # each poll read one new record, not the file so far
    assert sum(read) == rank_file(run_dir, 0).stat().st_size


def test_the_cli_progress_loop_reads_only_new_bytes(tmp_path, monkeypatch, capsys, rank_file_reads):
    """`labkit run`'s loop (progress bar, phase) polls rank 0's file for the whole run: each poll
    reads what was appended since the last one, at step 5 as at step 300."""
    import labkit.launch.run
    from labkit.cli import main
    from labkit.core.files import write_json_atomic
    from labkit.launch.summary import summarize

    steps = 300

    class GrowingRun(Run):
        """A run whose rank 0 writes one step per poll (each `wait`), then finishes; no processes."""

        def start(self):
            assert self._out is not None
            self.run_dir = self._out
            self.run_dir.mkdir(parents=True)
            write_json_atomic(self.run_dir / "config.json", self.config.to_dict())
            _append(rank_file(self.run_dir, 0), {"event": "start", "rank": 0, "time_s": 0.0},
                    {"event": "ready", "rank": 0, "time_s": 0.1})
            self.written = 0
            return self

        @property
        def status(self) -> str:
            summary = self.summary
            return summary["status"] if summary else "running"

        def wait(self, timeout=None, poll_s=0.2) -> str:
            assert self.run_dir is not None
            rank_file_reads.paused = True  # the run's side (its summary reads every record): not the CLI's
            if self.written < steps:
                self.written += 1
                _append(rank_file(self.run_dir, 0), {"event": "step", "rank": 0, "step": self.written,
                                                     "time_s": 0.1 * self.written, "step_time_s": 0.1,
                                                     "samples_per_s": 320.0, "loss": 1.0})
            elif not self.summary:
                _append(rank_file(self.run_dir, 0), {"event": "done", "rank": 0, "steps": steps, "time_s": 30.1})
                write_json_atomic(self.run_dir / "summary.json",
                                  summarize(self.run_dir, self.config.to_dict(), status="finished", cause=None))
            rank_file_reads.paused = False
            return self.status

    monkeypatch.setattr(labkit.launch.run, "Run", GrowingRun)
    run_dir = tmp_path / "run"
    assert main(["run", "--example", "pytorch", "--steps", str(steps), "--out", str(run_dir)]) == 0
    assert f"finished: {steps} steps" in capsys.readouterr().out
    size = rank_file(run_dir, 0).stat().st_size
    # Two readers (the phase's events and Run.progress()), each reading every byte once.
    reads = rank_file_reads.reads
    assert sum(reads) <= 2 * size
    line = len(json.dumps({"event": "step", "rank": 0, "step": steps, "time_s": 0.1 * steps, "step_time_s": 0.1,
                           "samples_per_s": 320.0, "loss": 1.0})) + 1
    assert max(reads) <= 2 * line  # one poll: one new record (the first: start and ready)


def test_damaged_lines_and_files_read_as_no_records(tmp_path):
    """Bytes that do not decode (UnicodeDecodeError) and a line that is JSON but no object (a list: AttributeError
    in every reader) broke export-metrics and predict --from; a rank file that is a directory, likewise."""
    from labkit.core.records import parse_lines
    from labkit.launch.export_metrics import to_csv

    good = {"event": "step", "step": 1, "loss": 2.0}
    data = b"\n".join([b"\xff\xfe junk", b"[1, 2]", b"7", json.dumps(good).encode(),
                       json.dumps({"event": "step", "loss": 1.0}).encode(),  # no step: no row to plot it at
                       json.dumps({"event": "step", "step": "x"}).encode(), b""])
    assert parse_lines(data) == [good, {"event": "step", "loss": 1.0}, {"event": "step", "step": "x"}]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rank_file(run_dir, 0).write_bytes(data)
    (written,) = to_csv(run_dir, tmp_path / "csv")
    assert written.read_text().splitlines() == ["step,loss", "1,2.0"]
    rank_file(run_dir, 1).mkdir()
    assert read_records(rank_file(run_dir, 1)) == []
