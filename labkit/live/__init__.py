"""Watching a run: per-rank telemetry written by the ranks, read incrementally, drawn live (dashboard, panel)."""
