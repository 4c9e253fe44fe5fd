"""Published DeepSpeed measurements (`data/published/points.csv`, cited per row in `data/published/README.md`) and
the predictor's figure for each: the check of `labkit.study.predict` against measurements it was not fitted to.

Where a source leaves a setting out, one rule fills it for every point (never a per-point choice):
* micro-batch not stated: global batch / GPUs (no gradient accumulation);
* global batch not stated: micro-batch x GPUs (no gradient accumulation either);
* activation checkpointing not stated: on exactly when the predicted memory says the micro-batch does not fit
  without it (what a user of that code had to do);
* `code` megatron-lm: the vocabulary is padded to a multiple of 128 (Megatron-LM's --make-vocab-size-divisible-by
  default, megatron/arguments.py), which the source's table does not repeat; Hugging Face models keep theirs;
* `arch` not stated: gpt2 (Hugging Face's GPT2LMHeadModel, as Megatron-LM's GPT); llama and qwen2 rows give `ffn`
  (the MLP's inner width) and may give `kv_heads` (grouped-query attention; empty: as many as heads) and
  `tied_embeddings` (empty: gpt2 tied, the others not), as the model's own config says (`flops.Transformer`);
* `attention` not stated: the arch's default kernels, eager for gpt2 (the 2019-2021 GPT codes materialise the scores)
  and sdpa for llama and qwen2 (transformers' default for them), as `flops.Transformer` says;
* dropout not stated (the `dropout` cell empty): the arch's default, 0.1 for gpt2 (Hugging Face's and Megatron-LM's
  GPT) and 0 for llama and qwen2 (their configs' attention_dropout); a code without dropout layers says 0;
* the link inside a node not stated (`intra` empty): the GPU kind's own (`auto`: its NVLink, else its PCIe);
* nodes not stated: GPUs / GPUs per node; the network not stated (`inter_gbps` empty): none on one node, and a
  point on many nodes without it is refused;
* `offload_optimizer` not stated: off (DeepSpeed's default);
* `zero` (the `zero_optimization` settings the source's config sets, `key=value,...`) empty: DeepSpeed 0.19.8's
  defaults, which is also what a row whose source does not print its config gets.

`load` checks every row before anything is predicted and names each problem by point and column, all at once: every
unreadable cell, and what combines cells (the shape, the cluster, the batches, the strategy, the FLOP formula, the
zero settings), each such check where the cells it reads read (`_COMBINED_READS`). A table of other points
(`benchmarks/bench_predict.py --points FILE`) is refused before any of it is predicted.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from labkit.runtime.hardware import Cluster
from labkit.runtime.hardware import gpu as find_gpu
from labkit.study import comms, flops
from labkit.study import predict as P

POINTS_CSV = Path(__file__).resolve().parents[2] / "data" / "published" / "points.csv"
# tokens_per_s: samples_per_s x seq, all GPUs; tokens_per_s_per_gpu: the same over the GPUs (as many sources print it)
METRICS = ("samples_per_s", "step_time_s", "tflops_per_gpu", "tokens_per_s", "tokens_per_s_per_gpu")
FLOPS_FORMULAS = ("megatron_sc21", "megatron_eq3_by_checkpointing")
MEGATRON_VOCAB_DIVISOR = 128
# Cells every point must fill (the README's columns); the other columns may be empty or absent, and the rules above
# fill them.
REQUIRED = ("point_id", "source", "locator", "layers", "hidden", "heads", "seq", "vocab", "gpu", "gpus",
            "gpus_per_node", "precision", "stage", "metric", "value")
OPTIONAL = ("model", "code", "dropout", "arch", "kv_heads", "ffn", "tied_embeddings", "attention", "nodes", "intra",
            "inter_gbps", "offload_optimizer", "activation_checkpointing", "micro_batch", "global_batch", "zero",
            "flops_formula", "notes")
POSITIVE_INTS = ("layers", "hidden", "heads", "seq", "vocab", "kv_heads", "ffn", "gpus", "gpus_per_node", "nodes",
                 "micro_batch", "global_batch")
NUMBERS = ("value", "inter_gbps", "dropout")
BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


def load(path: str | Path | None = None) -> Any:
    """The points of `path` (default data/published/points.csv), every row checked and the empty cells that a rule
    fills without predicting (nodes, inter_gbps, offload_optimizer) filled; a ValueError lists every problem."""
    import pandas as pd

    path = Path(path or POINTS_CSV)
    table = pd.read_csv(path, dtype=object, keep_default_na=False)
    missing = [c for c in REQUIRED if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; every point needs {', '.join(REQUIRED)}")
    unknown = [c for c in table.columns if c not in (*REQUIRED, *OPTIONAL)]
    if unknown:  # a misspelt column would otherwise leave its cells to a rule's default
        raise ValueError(f"{path}: unknown column(s) {', '.join(map(repr, unknown))}; the columns are "
                         f"{', '.join((*REQUIRED, *OPTIONAL))} (data/published/README.md)")
    if table.empty:
        raise ValueError(f"{path}: no points")
    for column in OPTIONAL:
        if column not in table.columns:
            table[column] = ""
    problems = [f"{row['point_id'] or f'row {i + 2}'}: {p}" for i, row in table.iterrows() for p in _check(row)]
    repeated = sorted(set(table["point_id"][table["point_id"].duplicated()]))
    if repeated:
        problems.append(f"point_id repeated: {', '.join(repeated)}")
    if problems:
        raise ValueError(f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return table.apply(_typed, axis=1)


def _check(row: Any) -> list[str]:
    """What is wrong with one row, each problem naming its column(s): every cell that does not read, then what
    combines cells (the shape, the cluster, the batches, the strategy, the FLOP formula) where the cells it combines
    read, so one pass names every problem a row has."""
    bad: dict[str, str] = {c: f"{c} is empty" for c in REQUIRED if _blank(row[c])}
    for c in POSITIVE_INTS:
        if not _blank(row[c]) and not (_integer(row[c]) and float(row[c]) >= 1):
            bad[c] = f"{c} must be a whole number >= 1, got {row[c]!r}"
    for c in NUMBERS:
        if not _blank(row[c]) and _number(row[c]) is None:
            bad[c] = f"{c} must be a finite number, got {row[c]!r}"
    value = _number(row["value"])
    if value is not None and value <= 0:
        bad["value"] = f"value must be > 0, got {row['value']!r}"
    for c in ("offload_optimizer", "activation_checkpointing", "tied_embeddings"):
        if not _blank(row[c]) and str(row[c]).strip().lower() not in BOOLEANS:
            bad[c] = f"{c} must be True or False, got {row[c]!r}"
    if not _blank(row["stage"]) and not (_integer(row["stage"]) and 0 <= float(row["stage"]) <= 3):
        bad["stage"] = f"stage must be 0, 1, 2 or 3, got {row['stage']!r}"
    if not _blank(row["precision"]) and row["precision"] not in P.PRECISIONS:
        bad["precision"] = f"precision must be one of {', '.join(P.PRECISIONS)}, got {row['precision']!r}"
    if not _blank(row["metric"]) and row["metric"] not in METRICS:
        bad["metric"] = f"metric must be one of {', '.join(METRICS)}, got {row['metric']!r}"
    if row["metric"] == "tflops_per_gpu" and row["flops_formula"] not in FLOPS_FORMULAS:
        bad["flops_formula"] = (f"tflops_per_gpu needs flops_formula, one of {', '.join(FLOPS_FORMULAS)}; "
                                f"got {row['flops_formula']!r}")
    if not _blank(row["gpu"]):
        try:
            find_gpu(str(row["gpu"]))
        except ValueError as err:
            bad["gpu"] = f"gpu: {err}"
    readable = row.astype(object)
    for c in bad:
        readable[c] = ""  # read as not given; a check that combines it is skipped below
    return [*bad.values(), *_check_combined(_typed(readable), skip=frozenset(bad))]


# The cells each check that combines cells reads: skipped where one of them does not read (its problem is named).
_COMBINED_READS = {
    "shape": ("layers", "hidden", "heads", "seq", "vocab", "dropout", "arch", "kv_heads", "ffn", "tied_embeddings",
              "attention", "code"),
    "cluster": ("gpu", "gpus", "gpus_per_node", "nodes", "intra", "inter_gbps"),
    "batches": ("gpus", "micro_batch", "global_batch"),
    "strategy": ("stage", "offload_optimizer"),
    "precision": ("gpu", "precision"),
    "zero": ("zero", "stage", "offload_optimizer"),
    "flops_formula": ("metric", "flops_formula", "activation_checkpointing"),
}


def _check_combined(row: Any, skip: frozenset[str] = frozenset()) -> list[str]:
    """The checks of a row that combine cells, each where the cells it reads read (`skip`: those that do not):
    each builds what `setup` builds, and says why it cannot."""
    checks = {"shape": lambda: _shape(row), "cluster": lambda: _cluster(row), "batches": lambda: batches(row),
              "strategy": lambda: _strategy(row), "precision": lambda: find_gpu(row["gpu"]).peak(row["precision"]),
              "zero": lambda: _check_zero(row)}
    if row["metric"] == "tflops_per_gpu":
        checks["flops_formula"] = lambda: flops_passes(row)
    out = []
    for name, check in checks.items():
        if skip & set(_COMBINED_READS[name]):
            continue
        try:
            check()
        except ValueError as err:
            out.append(f"{name}: {err}")
    return out


def _typed(row: Any) -> Any:
    """One row with its cells typed (ints, floats, bools) and the load-time rules applied (`_check`'s cells read)."""
    row = row.astype(object)  # a copy whose cells may take any type (pandas 3 reads the cells as str)
    for c in POSITIVE_INTS:
        row[c] = None if _blank(row[c]) else int(float(row[c]))
    for c in NUMBERS:
        row[c] = None if _blank(row[c]) else float(row[c])
    row["stage"] = None if _blank(row["stage"]) else int(float(row["stage"]))
    for c in ("offload_optimizer", "activation_checkpointing", "tied_embeddings"):
        row[c] = _bool(row[c])
    if row["nodes"] is None and row["gpus"] and row["gpus_per_node"] and row["gpus"] % row["gpus_per_node"] == 0:
        row["nodes"] = row["gpus"] // row["gpus_per_node"]
    if row["inter_gbps"] is None:
        row["inter_gbps"] = 0.0  # one node; on more nodes, _cluster refuses the point
    if row["offload_optimizer"] is None:
        row["offload_optimizer"] = False
    return row


def _bool(value: Any) -> bool | None:
    """A boolean cell: True/False (any case) or 1/0; None when empty."""
    if isinstance(value, bool):
        return value
    return None if _blank(value) else BOOLEANS[str(value).strip().lower()]


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _integer(value: Any) -> bool:
    number = _number(value)
    return number is not None and number == int(number)


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or str(value).strip() == ""


def megatron_flops_per_sample(layers: int, hidden: int, seq: int, vocab: int, passes: int = 4) -> float:
    """Megatron-LM SC21 Eq. 3 per sample: 24 x passes x s l h^2 (1 + s/(6h) + V/(16 l h)), in forwards' worth of
    FLOPs: the paper's 4 are the forward, the backward (2) and the recomputed forward."""
    return 24.0 * passes * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def flops_passes(row: Any) -> int:
    """Eq. 3's passes as the row's source counted them: `megatron_sc21` always 4 (the paper always recomputes);
    `megatron_eq3_by_checkpointing` 4 with activation checkpointing, else 3 (Megatron-DeepSpeed's
    throughput_calculator, megatron/utils.py, from 7041c862, 2022-08, until b7b2d5ef, 2024-08)."""
    if row["flops_formula"] == "megatron_sc21":
        return 4
    ckpt = _bool(row["activation_checkpointing"])
    if row["flops_formula"] == "megatron_eq3_by_checkpointing" and ckpt is not None:
        return 4 if ckpt else 3
    raise ValueError(f"tflops_per_gpu needs flops_formula, one of {', '.join(FLOPS_FORMULAS)} "
                     f"(megatron_eq3_by_checkpointing with activation_checkpointing stated); "
                     f"got {row['flops_formula']!r}")


def published_samples_per_s(row: Any) -> float:
    value = float(row["value"])
    if row["metric"] == "samples_per_s":
        return value
    if row["metric"] == "step_time_s":
        return batches(row)[2] / value
    if row["metric"] in ("tokens_per_s", "tokens_per_s_per_gpu"):
        return value * (float(row["gpus"]) if row["metric"] == "tokens_per_s_per_gpu" else 1.0) / int(row["seq"])
    per_sample = megatron_flops_per_sample(int(row["layers"]), int(row["hidden"]), int(row["seq"]), _vocab(row),
                                           flops_passes(row))
    return value * 1e12 * float(row["gpus"]) / per_sample


def _vocab(row: Any) -> int:
    """The vocabulary the code trains: Megatron-LM's padded to a multiple of 128 (its FLOP formula uses it too)."""
    vocab = int(row["vocab"])
    if row["code"] == "megatron-lm":
        vocab = -(-vocab // MEGATRON_VOCAB_DIVISOR) * MEGATRON_VOCAB_DIVISOR
    return vocab


def batches(row: Any) -> tuple[int, int, int]:
    """(micro-batch, accumulation, global batch) of a row, the batch rules of the module doc filling an empty one."""
    gpus = int(float(row["gpus"]))
    if _blank(row["global_batch"]) and _blank(row["micro_batch"]):
        raise ValueError("neither micro_batch nor global_batch is given")
    if _blank(row["global_batch"]):
        global_batch = int(float(row["micro_batch"])) * gpus
    else:
        global_batch = int(float(row["global_batch"]))
    micro = global_batch // gpus if _blank(row["micro_batch"]) else int(float(row["micro_batch"]))
    accum = global_batch // (micro * gpus) if micro >= 1 else 0
    if accum < 1 or micro * accum * gpus != global_batch:
        raise ValueError(f"global_batch {global_batch} is not micro_batch {micro} x accumulation x gpus {gpus}")
    return micro, accum, global_batch


def _shape(row: Any) -> flops.Transformer:
    """The row's transformer; empty cells take `flops.Transformer`'s defaults for the row's arch (gpt2 if empty)."""
    given: dict[str, Any] = {}
    for key, column, kind in (("dropout", "dropout", float), ("arch", "arch", str), ("kv_heads", "kv_heads", int),
                              ("ffn", "ffn", int), ("tied", "tied_embeddings", _bool), ("attention", "attention", str)):
        if not _blank(row.get(column)):
            given[key] = kind(float(row[column])) if kind is int else kind(row[column])
    return flops.Transformer(layers=int(row["layers"]), hidden=int(row["hidden"]), heads=int(row["heads"]),
                             seq=int(row["seq"]), vocab=_vocab(row), **given)


def _cluster(row: Any) -> Cluster:
    """GPU kind, GPUs per node, nodes and links; gpus must be all of them."""
    intra = "auto" if _blank(row["intra"]) else str(row["intra"])
    problems = []
    try:  # the link, whatever the node count
        Cluster(gpu=find_gpu(str(row["gpu"])), gpus_per_node=int(row["gpus_per_node"]), intra=intra)
    except ValueError as err:
        problems.append(str(err))
    if _blank(row["nodes"]):
        problems.append(f"nodes is empty and gpus {row['gpus']} is not a multiple of gpus_per_node "
                        f"{row['gpus_per_node']}")
    else:
        if int(row["gpus"]) != int(row["gpus_per_node"]) * int(row["nodes"]):
            problems.append(f"gpus {int(row['gpus'])} != gpus_per_node {int(row['gpus_per_node'])} x nodes "
                            f"{int(row['nodes'])}")
        if int(row["nodes"]) > 1 and (_number(row["inter_gbps"]) or 0) <= 0:
            problems.append("a point on more than one node needs inter_gbps (the node's network, Gb/s)")
    if problems:
        raise ValueError("; ".join(problems))
    return Cluster(gpu=find_gpu(str(row["gpu"])), gpus_per_node=int(row["gpus_per_node"]), nodes=int(row["nodes"]),
                   intra=intra, inter_gbps=0.0 if _blank(row["inter_gbps"]) else float(row["inter_gbps"]))


def _zero(row: Any) -> dict[str, Any]:
    """The row's `zero_optimization` settings (empty: DeepSpeed's defaults)."""
    return {} if _blank(row.get("zero")) else comms.zero_settings(str(row["zero"]))


def _check_zero(row: Any) -> None:
    """What DeepSpeed's config model says of the row's zero settings at its stage (none given: nothing to check)."""
    settings = _zero(row)
    if settings:
        comms.check_zero_settings(int(row["stage"]), settings, bool(_bool(row["offload_optimizer"])))


def _strategy(row: Any) -> str:
    strategy = f"z{int(float(row['stage']))}" + ("-offload" if _bool(row["offload_optimizer"]) else "")
    if strategy not in P.STRATEGIES:
        raise ValueError(f"stage {int(float(row['stage']))} with offload_optimizer: DeepSpeed offloads at stages 1-3")
    return strategy


def setup(row: Any) -> dict[str, Any]:
    """The predictor's arguments for one published row (the module doc's rules fill what the source leaves out)."""
    try:
        shape, cluster, (micro, accum, _), strategy = _shape(row), _cluster(row), batches(row), _strategy(row)
    except ValueError as err:
        raise ValueError(f"{row['point_id']}: {err}") from err
    workload = P.TransformerWorkload(shape, name=str(row["model"]))
    args: dict[str, Any] = dict(workload=workload, cluster=cluster, strategy=strategy, micro_batch=micro,
                                grad_accum=accum, precision=str(row["precision"]), zero=_zero(row))
    ckpt = _bool(row["activation_checkpointing"])
    if ckpt is None:
        ckpt = not P.predict(**args, activation_checkpointing=False).fits
    args["activation_checkpointing"] = ckpt
    return args


def _in_metric(row: Any, step_s: float, global_batch: int) -> float:
    """A predicted step of `global_batch` samples in the row's own metric."""
    if row["metric"] == "step_time_s":
        return step_s
    if row["metric"] == "samples_per_s":
        return global_batch / step_s
    # tokens, or the source's own FLOP formula, per sample, applied to the predicted throughput
    return float(row["value"]) / published_samples_per_s(row) * global_batch / step_s


def compare(table: Any | None = None) -> Any:
    """One row per published point: published and predicted in the source's own metric, and the relative error."""
    import pandas as pd

    table = load() if table is None else table
    rows = []
    for _, row in table.iterrows():
        args = setup(row)
        pred = P.predict(**args)
        published = float(row["value"])
        predicted, if_nothing_hides = (_in_metric(row, step, pred.global_batch)
                                       for step in (pred.step_time_s, pred.step_time_s_if_nothing_hides))
        rows.append({
            "point_id": row["point_id"], "source": row["source"], "gpu": row["gpu"], "gpus": int(row["gpus"]),
            "strategy": args["strategy"], "micro_batch": args["micro_batch"], "grad_accum": args["grad_accum"],
            "activation_checkpointing": args["activation_checkpointing"], "metric": row["metric"],
            "published": published, "predicted": predicted, "error": predicted / published - 1,
            # the same step with no communication hidden behind compute (beside the prediction, not the goal's)
            "predicted_if_nothing_hides": if_nothing_hides, "error_if_nothing_hides": if_nothing_hides / published - 1,
            "compute_s": pred.compute_s, "exposed_comm_s": pred.exposed_comm_s, "offload_s": pred.offload_s,
            "step_time_s": pred.step_time_s, "step_time_s_if_nothing_hides": pred.step_time_s_if_nothing_hides,
            "fits": pred.fits,
        })
    return pd.DataFrame(rows)


def summary(comparison: Any) -> dict[str, float]:
    errors = comparison["error"].abs()
    return {"points": len(errors), "median_abs_error": float(errors.median()), "max_abs_error": float(errors.max()),
            "sources": int(comparison["source"].nunique()), "gpu_kinds": int(comparison["gpu"].nunique())}
