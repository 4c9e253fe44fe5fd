"""What a run runs on: devices and their leases, DeepSpeed's import and JIT ops, the rendezvous, the size profile;
and, lowest so that every layer can use it, the check of the counts a notebook cell passes (`arguments`)."""
