"""What a rank trains: the seed's MLP (`mlp`), a small causal LM (`gpt`), the generated data, and `builders`,
which resolves a run's model/data/loss import strings."""
