"""What a run runs on: devices and their leases, DeepSpeed's import and JIT ops, the rendezvous, the size profile."""
