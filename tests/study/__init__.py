"""The study on top: sweep, max-batch, memory model, noise scale, answer, card, predict, notebooks."""
