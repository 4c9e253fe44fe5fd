"""Published DeepSpeed measurements (`data/published/points.csv`, cited per row in `data/published/README.md`) and
the predictor's figure for each: the check of `labkit.study.predict` against measurements it was not fitted to.

Where a source leaves a setting out, one rule fills it for every point (never a per-point choice):
* micro-batch not stated: global batch / GPUs (no gradient accumulation);
* global batch not stated: micro-batch x GPUs (no gradient accumulation either);
* activation checkpointing not stated: on exactly when the predicted memory says the micro-batch does not fit
  without it (what a user of that code had to do);
* `code` megatron-lm: the vocabulary is padded to a multiple of 128 (Megatron-LM's --make-vocab-size-divisible-by
  default, megatron/arguments.py), which the source's table does not repeat; Hugging Face models keep theirs;
* dropout not stated (the `dropout` cell empty): 0.1, the default of Hugging Face's and Megatron-LM's GPT
  (`flops.Transformer.dropout`); a code without dropout layers says 0;
* the link inside a node not stated (`intra` empty): the GPU kind's own (`auto`: its NVLink, else its PCIe).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from labkit.runtime.hardware import Cluster
from labkit.runtime.hardware import gpu as find_gpu
from labkit.study import flops
from labkit.study import predict as P

POINTS_CSV = Path(__file__).resolve().parents[2] / "data" / "published" / "points.csv"
METRICS = ("samples_per_s", "step_time_s", "tflops_per_gpu")
MEGATRON_VOCAB_DIVISOR = 128


def load(path: str | Path | None = None) -> Any:
    import pandas as pd

    table = pd.read_csv(path or POINTS_CSV)
    bad = sorted(set(table["metric"]) - set(METRICS))
    if bad:
        raise ValueError(f"unknown metric(s) {bad} in {path or POINTS_CSV}; known: {METRICS}")
    return table


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def megatron_flops_per_sample(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Megatron-LM SC21 Eq. 3 per sample: 96 s l h^2 (1 + s/(6h) + V/(16 l h)) (counts activation recomputation)."""
    return 96.0 * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def published_samples_per_s(row: Any) -> float:
    value = float(row["value"])
    if row["metric"] == "samples_per_s":
        return value
    if row["metric"] == "step_time_s":
        return float(row["global_batch"]) / value
    if row["flops_formula"] != "megatron_sc21":
        raise ValueError(f"{row['point_id']}: tflops_per_gpu needs a known flops_formula, got {row['flops_formula']!r}")
    per_sample = megatron_flops_per_sample(int(row["layers"]), int(row["hidden"]), int(row["seq"]), int(row["vocab"]))
    return value * 1e12 * float(row["gpus"]) / per_sample


def setup(row: Any) -> dict[str, Any]:
    """The predictor's arguments for one published row (the module doc's rules fill what the source leaves out)."""
    vocab = int(row["vocab"])
    if row["code"] == "megatron-lm":
        vocab = -(-vocab // MEGATRON_VOCAB_DIVISOR) * MEGATRON_VOCAB_DIVISOR
    dropout = row.get("dropout")
    shape = flops.Transformer(layers=int(row["layers"]), hidden=int(row["hidden"]), heads=int(row["heads"]),
                              seq=int(row["seq"]), vocab=vocab,
                              **({} if _blank(dropout) else {"dropout": float(dropout)}))
    intra = "auto" if _blank(row["intra"]) else str(row["intra"])
    cluster = Cluster(gpu=find_gpu(str(row["gpu"])), gpus_per_node=int(row["gpus_per_node"]), nodes=int(row["nodes"]),
                      intra=intra, inter_gbps=float(row["inter_gbps"] or 0))
    gpus = int(row["gpus"])
    if gpus != cluster.world_size:
        raise ValueError(f"{row['point_id']}: gpus {gpus} != gpus_per_node x nodes {cluster.world_size}")
    if _blank(row["global_batch"]) and _blank(row["micro_batch"]):
        raise ValueError(f"{row['point_id']}: neither micro_batch nor global_batch is given")
    global_batch = int(row["micro_batch"]) * gpus if _blank(row["global_batch"]) else int(row["global_batch"])
    micro = global_batch // gpus if _blank(row["micro_batch"]) else int(row["micro_batch"])
    accum = global_batch // (micro * gpus)
    if micro * accum * gpus != global_batch:
        raise ValueError(f"{row['point_id']}: global batch {global_batch} is not micro {micro} x accumulation x {gpus}")
    offload = str(row["offload_optimizer"]).lower() == "true"
    strategy = f"z{int(row['stage'])}" + ("-offload" if offload else "")
    workload = P.TransformerWorkload(shape, name=str(row["model"]))
    args: dict[str, Any] = dict(workload=workload, cluster=cluster, strategy=strategy, micro_batch=micro,
                                grad_accum=accum, precision=str(row["precision"]))
    ckpt = row["activation_checkpointing"]
    if _blank(ckpt):
        ckpt = not P.predict(**args, activation_checkpointing=False).fits
    args["activation_checkpointing"] = str(ckpt).lower() == "true"
    return args


def compare(table: Any | None = None) -> Any:
    """One row per published point: published and predicted in the source's own metric, and the relative error."""
    import pandas as pd

    table = load() if table is None else table
    rows = []
    for _, row in table.iterrows():
        args = setup(row)
        pred = P.predict(**args)
        published = float(row["value"])
        if row["metric"] == "samples_per_s":
            predicted = pred.samples_per_s
        elif row["metric"] == "step_time_s":
            predicted = pred.step_time_s
        else:  # the source's own FLOP formula applied to the predicted throughput
            per_sample = published / published_samples_per_s(row)
            predicted = per_sample * pred.samples_per_s
        rows.append({
            "point_id": row["point_id"], "source": row["source"], "gpu": row["gpu"], "gpus": int(row["gpus"]),
            "strategy": args["strategy"], "micro_batch": args["micro_batch"], "grad_accum": args["grad_accum"],
            "activation_checkpointing": args["activation_checkpointing"], "metric": row["metric"],
            "published": published, "predicted": predicted, "error": predicted / published - 1,
            "compute_s": pred.compute_s, "exposed_comm_s": pred.exposed_comm_s, "offload_s": pred.offload_s,
            "step_time_s": pred.step_time_s, "fits": pred.fits,
        })
    return pd.DataFrame(rows)


def summary(comparison: Any) -> dict[str, float]:
    errors = comparison["error"].abs()
    return {"points": len(errors), "median_abs_error": float(errors.median()), "max_abs_error": float(errors.max()),
            "sources": int(comparison["source"].nunique()), "gpu_kinds": int(comparison["gpu"].nunique())}
