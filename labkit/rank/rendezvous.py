"""Join the run's process group without listening beyond loopback on single-node runs.

torch's default `env://` rendezvous makes rank 0's TCPStore listen on every interface
(`::`), whatever MASTER_ADDR says. A lab on a shared cloud instance should expose nothing,
so when the run's master address is loopback, rank 0 binds the store's socket to 127.0.0.1
itself and hands it over (`master_listen_fd`); gloo's own sockets stay on `lo` through
GLOO_SOCKET_IFNAME (set by `labkit.launch.launcher`). DeepSpeed then adopts the initialised group.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

LOOPBACK = ("127.0.0.1", "localhost")


def init_distributed(backend: str, timeout: timedelta) -> None:
    import deepspeed
    import torch.distributed as dist

    if os.environ.get("MASTER_ADDR") in LOOPBACK and not dist.is_initialized():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        port = int(os.environ["MASTER_PORT"])
        listener = None
        if rank == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(max(world_size, 16))
        # detach(): the store's server keeps accepting on this descriptor for the whole run. With
        # fileno() the socket object, garbage-collected when this function returns, would close
        # it under the store; on NCCL, whose init does not wait for every rank, a slower rank
        # could then never join.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False,
                              master_listen_fd=listener.detach() if listener else None)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # Our own timeout: a peer that dies mid-collective raises instead of hanging for
    # DeepSpeed's default 10 minutes (labkit's supervisor also watches heartbeats).
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
