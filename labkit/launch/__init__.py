"""One run from configuration to record: config, launch command, supervisor, the rank's worker, the run store.

(Named `launch`, not `runs`: `labkit.runs()` is the public list of past runs.)
"""
