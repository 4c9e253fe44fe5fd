"""What the parent and the ranks share, below both: the run's config (`config`), the DeepSpeed config built from it
(`ds_config`), the record schema (`schema`), reading rank files (`records`), atomic files (`files`), the memory
model (`memory`). Imports only `runtime/` (and nothing of it at import time but the light `arguments`)."""
