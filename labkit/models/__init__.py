"""Built-in models beyond the seed's MLP (labkit.builders names them): `gpt`, a small causal LM."""
