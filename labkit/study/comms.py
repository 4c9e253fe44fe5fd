"""TEMPORARY STAND-IN, written on branch predict23 only because branch comms23 had not committed its module yet.

The real `labkit.study.comms` (what DeepSpeed 0.19.8 sends, with source lines, bucket counts, the comms-log
reader and the link benchmark) is being written on branch comms23; `git merge comms23` REPLACES this file (take
theirs on conflict). This stand-in keeps only the interface the predictor uses, with one aggregated collective per
kind (count 1), from the facts in the team brief.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    op: str            # all_reduce | all_gather | reduce_scatter
    bytes: float       # all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the input
    count: int
    per: str           # micro_step | step
    phase: str         # forward | backward | optimizer
    dtype: str
    overlappable: bool


def collectives(stage: int, n_params: int, world_size: int, *, precision: str, grad_accum: int = 1,
                offload_optimizer: bool = False, persistent_params: int = 0, **_: object) -> list[Collective]:
    if world_size < 2:
        return []
    size = 4 if precision == "fp32" else 2
    dtype = "fp32" if precision == "fp32" else precision
    full = size * n_params
    if stage == 0:
        return [Collective("all_reduce", full, 1, "step", "backward", dtype, False)]
    if stage in (1, 2):
        per = "step" if stage == 1 else "micro_step"
        return [Collective("all_reduce", full, 1, per, "backward", dtype, False),
                Collective("all_gather", full, 1, "step", "optimizer", dtype, False)]
    sharded = size * max(0, n_params - persistent_params)
    return [Collective("all_gather", sharded, 1, "micro_step", "forward", dtype, True),
            Collective("all_gather", sharded, 1, "micro_step", "backward", dtype, True),
            Collective("reduce_scatter", full, 1, "micro_step", "backward", dtype, True)]


def ring_bytes_sent(c: Collective, world_size: int) -> float:
    factor = 2 * (world_size - 1) / world_size if c.op == "all_reduce" else (world_size - 1) / world_size
    return factor * c.bytes


# -- the link benchmark (stand-in too: comms23's measure_links replaces it) --------------------------------------------
@dataclass(frozen=True)
class LinkFit:
    world_size: int
    backend: str
    ops: dict          # op -> {"alpha_s", "beta_s_per_byte", "bus_gbps"}
    raw: list          # (op, message bytes, ring bytes, seconds) per timing


def _bench_worker(rank: int, world_size: int, port: int, sizes: tuple, ops: tuple, repeats: int, queue: object) -> None:
    import os
    import time

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = []
    for op in ops:
        for size in sizes:
            n = max(world_size, size // 4 // world_size * world_size)
            full, part = torch.ones(n), torch.ones(n // world_size)
            def run(op: str = op, f: torch.Tensor = full, p: torch.Tensor = part) -> None:
                if op == "all_reduce":
                    dist.all_reduce(f)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(f, p)
                else:
                    dist.reduce_scatter_tensor(p, f)
            try:
                run()
            except (RuntimeError, ValueError):
                break  # the backend lacks this collective
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            rows.append((op, n * 4, sorted(times)[len(times) // 2]))
    if rank == 0:
        queue.put(rows)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def measure_links(world_size: int = 2, sizes: tuple = (4_096, 65_536, 1_048_576, 4_194_304),
                  ops: tuple = ("all_reduce", "all_gather", "reduce_scatter"), backend: str | None = None,
                  repeats: int = 9) -> LinkFit:
    """Time each collective at each message size in `world_size` real processes (gloo on loopback), and fit
    time = alpha + ring bytes x beta per op (least squares)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_bench_worker, args=(r, world_size, port, sizes, ops, repeats, queue))
             for r in range(world_size)]
    import queue as queues
    import time

    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    while True:
        try:
            rows = queue.get(timeout=1)
            break
        except queues.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"measure_links: a benchmark process failed (exit codes {failed})") from None
    for p in procs:
        p.join(timeout=60)
    fits: dict = {}
    raw = []
    for op in ops:
        pts = [(Collective(op, b, 1, "step", "backward", "fp32", False), t) for o, b, t in rows if o == op]
        if len(pts) < 2:
            continue
        xs = [ring_bytes_sent(c, world_size) for c, _ in pts]
        ys = [t for _, t in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        alpha = max(my - beta * mx, 0.0)
        fits[op] = {"alpha_s": alpha, "beta_s_per_byte": beta, "bus_gbps": 8 / beta / 1e9 if beta > 0 else None}
        raw += [(op, c.bytes, x, t) for (c, t), x in zip(pts, xs, strict=True)]
    return LinkFit(world_size, backend or "gloo", fits, raw)
