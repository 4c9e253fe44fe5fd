"""Tables, figures and the widget binding of notebook 06 ("What about my GPUs?"): plain functions over
`labkit.study.predict`, so the notebook only binds controls to them. Every predicted figure says "predicted".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.runtime.hardware import GPUS, INTRA_LINKS, NETWORK_GBPS, Cluster
from labkit.runtime.hardware import gpu as find_gpu
from labkit.study import flops
from labkit.study import predict as P
from labkit.study.noise_scale import language_model_b_crit_source

# Transformer shapes a learner may pick (GPT-2 sizes, Hugging Face's configs; GPT-3 sizes from Brown et al. 2020,
# Table 2.1; Qwen2.5-1.5B and Llama-2 7B by their Hugging Face config.json, at the sequence of the published
# Qwen2.5 runs, data/published/ source 8, and Llama 2's context) beside the lab's own models.
SHAPES: dict[str, flops.Transformer] = {
    "GPT-2 small (124M)": flops.Transformer(layers=12, hidden=768, heads=12, seq=1024),
    "GPT-2 medium (355M)": flops.Transformer(layers=24, hidden=1024, heads=16, seq=1024),
    "GPT-2 large (774M)": flops.Transformer(layers=36, hidden=1280, heads=20, seq=1024),
    "GPT-2 XL (1.5B)": flops.Transformer(layers=48, hidden=1600, heads=25, seq=1024),
    "GPT-3 2.7B": flops.Transformer(layers=32, hidden=2560, heads=32, seq=2048),
    "GPT-3 6.7B": flops.Transformer(layers=32, hidden=4096, heads=32, seq=2048),
    "Qwen2.5-1.5B (seq 512)": flops.Transformer(arch="qwen2", layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960,
                                                seq=512, vocab=151936, tied=True),
    "Llama-2 7B (seq 4096)": flops.Transformer(arch="llama", layers=32, hidden=4096, heads=32, ffn=11008, seq=4096,
                                               vocab=32000),
}
LAB_MODELS = ("lab GPT (ci size)", "lab MLP (ci answer)")
STRATEGY_LABELS = {"torch": "plain PyTorch DDP", "z0": "ZeRO-0", "z1": "ZeRO-1", "z2": "ZeRO-2", "z3": "ZeRO-3",
                   "z1-offload": "ZeRO-1 + offload", "z2-offload": "ZeRO-2 + offload", "z3-offload": "ZeRO-3 + offload"}


def workload(name: str) -> P.Workload:
    """A transformer shape from SHAPES, one of the lab's models (built on the meta device), or the learner's own
    transformer as `labkit predict --transformer` takes it: its shape, or its Hugging Face config.json with the
    sequence (`hf=path/to/config.json,seq=2048`)."""
    if name in SHAPES:
        return P.TransformerWorkload(SHAPES[name], name=name)
    if "=" in name:
        return P.TransformerWorkload(flops.Transformer.parse(name), name=name)
    from labkit.core.config import RunConfig

    if name == "lab GPT (ci size)":
        from labkit.models.gpt import SIZES

        return P.lab_workload(RunConfig.from_dict({"example": "deepspeed", **SIZES["ci"]}))
    if name == "lab MLP (ci answer)":
        return P.ModuleWorkload(RunConfig.from_dict({"example": "deepspeed", "hidden": 512, "depth": 2}))
    raise ValueError(f"unknown model {name!r}; known: {', '.join((*SHAPES, *LAB_MODELS))}, or yours as "
                     "layers=,hidden=,heads=,seq=... or hf=path/to/config.json,seq=N")


DATA = Path(__file__).resolve().parents[2] / "data"
# The lab's models' own measured critical batch: the committed answers' gradient-noise probes (notebook 04)
LAB_B_CRIT_RESULTS = {"lab GPT (ci size)": DATA / "reference-ci-gpt", "lab MLP (ci answer)": DATA / "reference-ci"}


def b_crit_for(name: str, target_loss: float, work: P.Workload | None = None) -> tuple[float | None, str]:
    """(B_crit in the model's samples, where it comes from) for the time to the same loss: a transformer's from
    Kaplan et al.'s power law at `target_loss` nats per token (`noise_scale.language_model_b_crit`, in its sequences);
    the lab's models (the GPT reads bytes, not GPT-2's tokens) their own answers' (`predict.measured_b_crit`).
    `work`: `workload(name)` where the caller has it."""
    if name in LAB_B_CRIT_RESULTS:
        path = LAB_B_CRIT_RESULTS[name]
        measured = P.measured_b_crit(path, shown_as=f"data/{path.name}")
        return measured or (None, f"no critical batch: data/{path.name} places none")
    work = work or workload(name)
    if not isinstance(work, P.TransformerWorkload):
        return None, "no critical batch for this model"
    return (P.language_model_b_crit(target_loss, work.shape.seq),
            language_model_b_crit_source(target_loss, work.shape.seq))


def card_table(card: dict[str, Any]) -> pd.DataFrame:
    """The (predicted) answer card as a table: one row per way, one column per time, and where a time has no
    verdict, why (`no verdict because`: a side that does not fit, one device, no critical batch)."""
    rows = []
    for way, kinds in card["ways"].items():
        row: dict[str, Any] = {"way": way}
        why = []
        for kind, entry in kinds.items():
            if entry["verdict"] is None:
                row[kind] = "-"
                why.append(entry["condition"].removeprefix("predicted: "))
            else:
                row[kind] = f"predicted {entry['verdict']} ({entry['ratio']:.2f}x)"
        step = kinds["per_step"]
        row["batch"] = f"{step['from_batch']} -> {step['to_batch']}" if step["from_batch"] else "-"
        row["no verdict because"] = "; ".join(dict.fromkeys(why))  # the same reason once
        rows.append(row)
    return pd.DataFrame(rows)


STRATEGY_PARTS = ("torch", "z0", "z1", "z2", "z3", "z2-offload")  # the bars the widgets draw, and the chosen one


def strategy_parts(work: P.Workload, cluster: Cluster, *, micro_batch: int, precision: str = "bf16",
                   strategies: tuple[str, ...] = STRATEGY_PARTS,
                   activation_checkpointing: bool = False) -> pd.DataFrame:
    """Predicted seconds per step of each strategy, split into the device's compute, the time it waits on the host
    (ZeRO-3's hooks, kernel launches: `host_bound_s`), exposed communication and offload. A micro-batch too large to
    count is a ValueError saying so, as in `explore`."""
    if isinstance(strategies, str):  # "z3" would be read letter by letter
        raise ValueError(f"strategies is a tuple of strategy names, e.g. ({strategies!r},), got {strategies!r}")
    rows = []
    for strategy in strategies:
        with _countable(f"model {getattr(work, 'name', work)!r} with micro_batch {micro_batch}"):
            p = P.predict(work, cluster, strategy=strategy, micro_batch=micro_batch, precision=precision,
                          activation_checkpointing=activation_checkpointing)
        rows.append({"strategy": STRATEGY_LABELS[strategy], "compute_s": p.compute_s - p.host_bound_s,
                     "host_bound_s": p.host_bound_s,
                     "exposed_comm_s": p.exposed_comm_s, "hidden_comm_s": p.comm_s - p.exposed_comm_s,
                     "offload_s": p.offload_s, "step_time_s": p.step_time_s, "fits": p.fits,
                     "max_micro_batch": p.max_micro_batch})
    return pd.DataFrame(rows)


def parts_figure(parts: pd.DataFrame, title: str) -> Any:
    """A stacked bar per strategy: the device's compute, waiting on the host, exposed communication, offload
    (predicted seconds per step)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    # a strategy that does not fit keeps its bar (the time it would take) but says so under it, faded
    labels = [name if fits else f"{name}<br>(does not fit)" for name, fits in zip(parts["strategy"], parts["fits"],
                                                                                  strict=True)]
    opacity = [1.0 if fits else 0.35 for fits in parts["fits"]]
    for column, name in (("compute_s", "compute"), ("host_bound_s", "waiting on the host"),
                         ("exposed_comm_s", "exposed communication"), ("offload_s", "offload")):
        fig.add_bar(x=labels, y=parts[column], name=name, marker_opacity=opacity)
    fig.update_layout(barmode="stack", title=f"Predicted: {title}", yaxis_title="predicted seconds per step",
                      height=380, margin=dict(l=60, r=20, t=60, b=40))
    return fig


def published_figure(comparison: pd.DataFrame) -> Any:
    """Predicted against published, one marker per point (log-log), with the y = x line and +-25% / +-40% bands;
    where some communication hides behind compute in the model, a bar reaches the prediction with none hidden."""
    import plotly.graph_objects as go

    fig = go.Figure()
    low = float(min(comparison["published"].min(), comparison["predicted"].min())) * 0.5
    high = float(max(comparison["published"].max(), comparison["predicted"].max())) * 2
    for factor, dash in ((1.0, "solid"), (1.25, "dot"), (0.75, "dot"), (1.4, "dash"), (0.6, "dash")):
        fig.add_scatter(x=[low, high], y=[low * factor, high * factor], mode="lines", showlegend=False,
                        line=dict(color="gray", dash=dash, width=1))
    for source, group in comparison.groupby("source"):
        # up for a step time, down for a throughput; none (NaN: no bar, no cap) where nothing hides
        to = group["predicted_if_nothing_hides"] - group["predicted"]
        hidden = to != 0
        text = group["point_id"] + " (" + group["metric"] + ")" + group["predicted_if_nothing_hides"].map(
            lambda v: f", with nothing hidden {v:.3g}").where(hidden, "")
        fig.add_scatter(x=group["published"], y=group["predicted"], mode="markers", name=str(source), text=text,
                        marker=dict(size=9), error_y=dict(type="data", symmetric=False, array=to.where(to > 0),
                                                          arrayminus=(-to).where(to < 0), thickness=2, width=5))
    fig.update_layout(title="Published measurements against the model's prediction",
                      xaxis=dict(title="published (the source's metric)", type="log"),
                      yaxis=dict(title="predicted (same metric)", type="log"), height=460)
    return fig


def cpu_figure(table: pd.DataFrame) -> Any:
    """This machine: predicted 2-rank step time (calibrated on the 1-rank run) against the measured one."""
    import plotly.graph_objects as go

    labels = table["strategy"] + " micro " + table["micro_batch"].astype(str)
    fig = go.Figure()
    fig.add_bar(x=labels, y=table["measured_1_rank_s"] * 1e3, name="measured, 1 rank")
    fig.add_bar(x=labels, y=table["predicted_2_rank_s"] * 1e3, name="predicted, 2 ranks")
    fig.add_bar(x=labels, y=table["measured_2_rank_s"] * 1e3, name="measured, 2 ranks")
    fig.update_layout(barmode="group", title="This machine: 2 ranks predicted from 1-rank runs",
                      yaxis_title="step time (ms)", height=400)
    return fig


def gpu_figure(table: pd.DataFrame) -> Any:
    """The lab's runs on a GPU (`calibrate.gpu_comparison`): each point's measured step beside its PREDICTED ones,
    from its config alone and calibrated on the other micro-batch's run, its miss read both ways (log scale)."""
    import plotly.graph_objects as go

    rows = table.dropna(subset=["calibrated_s"])
    if rows.empty:
        raise ValueError("no GPU point here has a run of the same training at another micro-batch to calibrate on")
    labels = rows["gpu"] + " " + rows["strategy"] + " micro " + rows["micro_batch"].astype(str)
    bars = {"measured": rows["measured_s"] * 1e3, "predicted from its config": rows["predicted_s"] * 1e3,
            "predicted, calibrated: the miss as fixed work": rows["calibrated_s"] * 1e3,
            "predicted, calibrated: the miss as a slower device":
                (1 + rows["if_the_miss_grows_error"]) * rows["measured_s"] * 1e3}
    fig = go.Figure()
    for name, ms in bars.items():
        fig.add_bar(x=labels, y=ms, name=name)
    low, high = min(float(ms.min()) for ms in bars.values()), max(float(ms.max()) for ms in bars.values())
    fig.update_layout(barmode="group", title="On a GPU: one run's micro-batch predicted from the other's run",
                      yaxis_title="step time (ms, log)", yaxis_type="log", height=400,
                      yaxis_range=[math.log10(low / 2), math.log10(high * 1.5)])  # every bar's top in view
    return fig


def explore(*, gpu: str, gpus_per_node: int, nodes: int, intra: str, inter_gbps: float, model: str,
            strategy: str, micro_batch: int, precision: str = "bf16", b_crit: float | None = None,
            target_loss: float | None = None,
            activation_checkpointing: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """What the widgets show: the predicted card (both ways to grow the batch, and accumulation), the strategies'
    stacked parts, and a one-line summary. The time to the same loss takes `b_crit`, or `b_crit_for(model,
    target_loss)`; neither: no verdict to the same loss. Raises ValueError with the reason for a choice that cannot
    be, and for a model or micro-batch too large to count (`predict.too_large_to_count`)."""
    with _countable(f"model {model!r} with micro_batch {micro_batch}"):
        return _explore(gpu=gpu, gpus_per_node=gpus_per_node, nodes=nodes, intra=intra, inter_gbps=inter_gbps,
                        model=model, strategy=strategy, micro_batch=micro_batch, precision=precision, b_crit=b_crit,
                        target_loss=target_loss, activation_checkpointing=activation_checkpointing)


@contextlib.contextmanager
def _countable(given: str) -> Iterator[None]:
    """PyTorch's sizes overflowing, or the trace's memory running out, as a ValueError naming `given`
    (`predict.too_large_to_count`); any other error as it was."""
    try:
        yield
    except (RuntimeError, TypeError, OverflowError, MemoryError) as exc:
        reason = P.too_large_to_count(exc, given)
        if reason is None:
            raise
        raise ValueError(reason) from None


def _explore(*, gpu: str, gpus_per_node: int, nodes: int, intra: str, inter_gbps: float, model: str,
             strategy: str, micro_batch: int, precision: str, b_crit: float | None, target_loss: float | None,
             activation_checkpointing: bool) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    if b_crit is not None and target_loss is not None:
        raise ValueError("give b_crit or target_loss, not both")
    if not isinstance(activation_checkpointing, bool):  # "no" would read as True
        raise ValueError(f"activation_checkpointing must be True or False, got {activation_checkpointing!r}")
    why = "given" if b_crit is not None else None
    kind = find_gpu(gpu)
    if precision == "bf16" and not kind.peak_flops.get("bf16"):
        precision = "fp16"  # V100 and T4 have no bf16 tensor cores
    cluster = Cluster(gpu=kind, gpus_per_node=gpus_per_node, nodes=nodes, intra=intra,
                      inter_gbps=inter_gbps if nodes > 1 else 0.0)
    work = workload(model)
    if target_loss is not None:
        b_crit, why = b_crit_for(model, target_loss, work)
    card = P.predicted_card(work, cluster, strategy=strategy, micro_batch=micro_batch, precision=precision,
                            activation_checkpointing=activation_checkpointing, b_crit=b_crit)
    shown = STRATEGY_PARTS if strategy in STRATEGY_PARTS else (*STRATEGY_PARTS, strategy)  # the chosen one too
    parts = strategy_parts(work, cluster, micro_batch=micro_batch, precision=precision, strategies=shown,
                           activation_checkpointing=activation_checkpointing)
    one = P.predict(work, cluster, strategy=strategy, micro_batch=micro_batch, precision=precision,
                    activation_checkpointing=activation_checkpointing)
    summary = (f"Predicted for {cluster.describe()}, {work.name}, {STRATEGY_LABELS[strategy]}, {precision}: "
               f"{one.step_time_s:.3g} s per step"
               + (f" ({one.step_time_s_if_nothing_hides:.3g} s with no communication hidden)"
                  if one.step_time_s_if_nothing_hides != one.step_time_s or one.caveats else "")
               + f", {one.samples_per_s:.4g} samples/s, "
               f"{one.hardware_tflops_per_gpu:.3g} TFLOP/s per GPU; fits: {one.fits} (largest micro-batch "
               f"{one.max_micro_batch})"
               + (f": the optimizer step alone needs {one.step_peak_bytes / 1e9:.1f} GB of the "
                  f"{one.usable_memory_bytes / 1e9:.1f} GB a process can use"
                  if one.step_peak_bytes > one.usable_memory_bytes else "")
               + _if_checkpointed(one, work, cluster, precision, activation_checkpointing)
               + (f". To the same loss: B_crit {b_crit:,.0f} samples ({why})" if b_crit is not None else "")
               + "".join(f". Caveat: {text}" for text in one.caveats))
    return card_table(card), parts, summary


def _if_checkpointed(one: P.Prediction, work: P.Workload, cluster: Cluster, precision: str,
                     checkpointed: bool) -> str:
    """For a transformer step that does not fit without activation checkpointing: how far it fits with it (the
    other way to fit, as `labkit predict`'s max_micro_batch_by_strategy_with_activation_checkpointing says)."""
    if one.fits or checkpointed or not isinstance(work, P.TransformerWorkload):  # the lab's models do not checkpoint
        return ""
    largest = P.predict(work, cluster, strategy=one.strategy, micro_batch=one.micro_batch, precision=precision,
                        activation_checkpointing=True).max_micro_batch
    return (f". With activation checkpointing (a recomputed forward per micro-step) it is predicted to fit up to "
            f"micro-batch {largest}" if largest else ". It does not fit with activation checkpointing either")


def controls() -> dict[str, Any]:
    """The choices the widgets offer. A link the chosen GPU cannot have (`hardware.links_for`) is refused by
    `explore` with the reason, which the notebook's widget prints."""
    return {"gpu": list(GPUS), "intra": list(INTRA_LINKS), "model": [*SHAPES, *LAB_MODELS],
            "strategy": [s for s in P.STRATEGIES if s in STRATEGY_LABELS], "network_gbps": dict(NETWORK_GBPS)}
