"""Everything that runs inside a rank: `python -m labkit.rank.worker` (behind `guard`) trains one rank, with its
trainers, step loop and clock, batches, telemetry writer, census, comms log, noise probe, rendezvous and fault
injection; `script` is the `labkit.record` hook of a user's own script. Imports neither `launch`, `ui` nor `study`."""
