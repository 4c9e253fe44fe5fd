"""Studies over many runs: the sweep, max-batch search, memory model, critical batch, the answer and its report."""
