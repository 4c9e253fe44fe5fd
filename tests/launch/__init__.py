"""The parent side of a run: command, supervisor, run handle, store, admission, leases, multi-node, jobs."""
