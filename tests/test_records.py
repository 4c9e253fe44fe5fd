"""Watching a run costs O(1) per poll: the readers read only the bytes written since the last poll."""

from __future__ import annotations

import json

from labkit.launch.config import RunConfig
from labkit.launch.run import Run
from labkit.live.records import RecordTail, read_records
from labkit.live.telemetry import rank_file


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


def test_run_progress_reads_only_new_bytes(tmp_path, monkeypatch):
    """The CLI's progress bar polls Run.progress() twice a second for the whole run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = RunConfig(example="pytorch", world_size=1, steps=1000)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    run = Run.load(run_dir)
    read = []
    real_open = open

    class CountingFile:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def seek(self, offset):
            return self.handle.seek(offset)

        def read(self, *args):
            data = self.handle.read(*args)
            read.append(len(data))
            return data

    def counting_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return CountingFile(handle) if str(path) == str(rank_file(run_dir, 0)) and "r" in mode else handle

    monkeypatch.setattr("builtins.open", counting_open)
    for step in range(1, 301):
        _append(rank_file(run_dir, 0), {"event": "step", "step": step, "loss": 1.0})
        assert run.progress() == step
    line = len(json.dumps({"event": "step", "step": 300, "loss": 1.0})) + 1
    assert max(read) <= line  # each poll read one new record, not the file so far
    assert sum(read) == rank_file(run_dir, 0).stat().st_size
