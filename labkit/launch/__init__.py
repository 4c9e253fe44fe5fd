"""The parent side of a run: command (`launcher`), supervisor, run handle, store, history, summary, export,
multi-node, job start, admission, device leases, phase.

(Named `launch`, not `runs`: `labkit.runs()` is the public list of past runs.)
"""
