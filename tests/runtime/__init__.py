"""The machine: devices, op builds and their locks, GPU paths, packaging and the offline install."""
