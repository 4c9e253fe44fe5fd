"""The step-time predictor against measurements it was not fitted to (labkit.study.predict, docs/predict.md).

    python benchmarks/bench_predict.py                 # every check from committed data (about a minute)
    python benchmarks/bench_predict.py --measure       # re-measure the CPU runs here first (~2 min, quiet machine)
    python benchmarks/bench_predict.py --points FILE   # other published points, in points.csv's columns (only them)
    python benchmarks/bench_predict.py --measure-zero3-ranks   # ZeRO-3's host work vs ranks (~4 min, quiet machine)

1. Published GPU points (data/published/points.csv): predicted / published per point; goals: median |error| <= 25%,
   every point <= 40% (tests/study/test_predict_published.py holds what the model reaches today).
   Where this lab measured a GPU kind (data/reference-*/gpu_constants.json, benchmarks/bench_gpu_constants.py),
   the GEMM roofline against every GEMM of that grid (the model takes one number per dtype from it: the median rate
   per SM of the GEMMs marked `calibrates`, whole tiles, a tile per SM, >= 0.1 ms, on the tensor cores).
2. This machine: calibrated on 1-rank runs (the answer's ci MLP, every strategy, micro-batch 16/64/256, one thread
   per rank), the 2-rank points predicted with the link fit measured here as training meets it
   (labkit.study.comms.measure_training_links: after 0.25-4 ms of compute, the mean call, read at each run's own
   compute per collective) and set against 2-rank runs of the same configs,
   measured in alternating 1-rank / 2-rank pairs, each run summarised by its mean step. Goal: median |error| <= 15%,
   every point <= 30%.
3. The lab's own runs on a GPU (data/reference-<gpu>/results.csv, or answer-partial/results.csv until an answer is
   whole): each finished point's median step PREDICTED for that GPU kind from its config alone (no goal: steps under
   TINY_STEP_S are launch-bound, which the model's launch term predicts short, and the lab's models are small).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "data" / "predict-ci"
STRATEGIES = {"z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False), "z2-offload": (2, True)}
MICRO_BATCHES = (16, 64, 256)
MODEL = dict(hidden=512, depth=2, dataset_size=8192, optimizer="adam", lr=2e-3)  # the answer's ci profile MLP
STEPS = 60


def measure(out: Path) -> None:
    """One pass: 1-rank and 2-rank runs of every strategy x micro-batch, one at a time (no two share a core),
    alternating. Each pass is added to runs_all.csv; runs.csv keeps the first pass, whose link fit links.json is
    (no choosing among passes: the mean of each run is compared, and a per-row fastest pass would bias the noisier
    2-rank runs down); host.json keeps the least of every ZeRO-3 fetch probe."""
    import os

    import pandas as pd

    from labkit.core.config import RunConfig
    from labkit.launch.run import Run
    from labkit.study import comms

    out.mkdir(parents=True, exist_ok=True)
    previous = pd.read_csv(out / "runs_all.csv") if (out / "runs_all.csv").exists() else None
    this_pass = 1 if previous is None else int(previous["pass"].max()) + 1
    rows = []
    for strategy, (stage, offload) in STRATEGIES.items():
        for micro in MICRO_BATCHES:
            for world_size in (1, 2):
                config = RunConfig(example="offload" if offload else "deepspeed", stage=stage,
                                   offload_optimizer=offload, world_size=world_size, micro_batch=micro, steps=STEPS,
                                   threads_per_rank=1, **MODEL)
                name = f"pass{this_pass}-{strategy}-w{world_size}-m{micro}"
                run = Run(config, out=out / "runs" / name).start()
                status = run.wait()
                if status != "finished":
                    print(f"{strategy} w{world_size} m{micro}: {status} ({run.cause})", flush=True)
                    continue
                rows += run_rows(strategy, run.run_dir)
                mean = next(r for r in rows[::-1] if r["statistic"] == "mean")
                print(f"{strategy} w{world_size} m{micro}: mean step {mean['step_time_s'] * 1e3:.2f} ms", flush=True)
    every = pd.concat([previous, pd.DataFrame(rows).assign(**{"pass": this_pass})], ignore_index=True)
    every.to_csv(out / "runs_all.csv", index=False)
    keys = ["strategy", "world_size", "micro_batch", "statistic"]
    every[every["pass"] == every["pass"].min()].sort_values(keys).to_csv(out / "runs.csv", index=False)
    from labkit.study.predict import link_fit_json

    if not (out / "links.json").exists():  # the first pass's fit is kept: no choosing among fits
        # as training meets the link (compute between calls, no barrier), every call kept: calibrate fits it by the
        # statistic the runs are compared with
        link = comms.measure_links(world_size=2, busy_s=comms.TRAINING_BUSY_S, reps=comms.TRAINING_REPS,
                                   statistic="mean")
        (out / "links.json").write_text(json.dumps({**link_fit_json(link, raw=True),
                                                    "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                    "load_average": list(os.getloadavg())}, indent=2))
    if not (out / "links_grid.json").exists():  # the same at every setting of the grid: what the check reads
        (out / "links_grid.json").write_text(json.dumps({**comms.measure_training_links(world_size=2),
                                                         "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                         "load_average": list(os.getloadavg())}))
    from labkit.study.calibrate import measure_zero3_fetch_s

    host = measure_zero3_fetch_s()
    if (out / "host.json").exists():
        host["observations_s"] = json.loads((out / "host.json").read_text())["observations_s"] + host["observations_s"]
        host["zero3_fetch_s"] = min(host["observations_s"])
    host.update(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_average=list(os.getloadavg()))
    (out / "host.json").write_text(json.dumps(host, indent=2))
    machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    machine.setdefault("passes", []).append({"pass": this_pass, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                             "load_average_at_end": list(os.getloadavg())})
    machine.update(cpu_cores=os.cpu_count(), threads_per_rank=1, steps=STEPS)
    (out / "machine.json").write_text(json.dumps(machine, indent=2))


def run_rows(strategy: str, run_dir: object) -> list[dict]:
    """runs.csv's rows for one run: its phases by every statistic (calibrate.STATISTICS)."""
    from labkit.study.calibrate import STATISTICS, read_run

    rows = []
    for statistic in STATISTICS:
        measured = read_run(str(run_dir), statistic)
        rows.append({"strategy": strategy, "world_size": measured.world_size,
                     "micro_batch": int(measured.config["micro_batch"]), "statistic": statistic,
                     "forward_s": measured.forward_s, "backward_s": measured.backward_s,
                     "optimizer_s": measured.optimizer_s, "step_time_s": measured.step_time_s,
                     "steps": measured.steps, "config": json.dumps(measured.config, sort_keys=True)})
    return rows


def cpu_check(data: Path = DATA) -> object:
    """predicted / measured for every 2-rank point, calibrated on the 1-rank run of the same strategy and
    micro-batch, each run summarised by the mean of its steps, the link's calls by theirs (a DataFrame)."""
    from labkit.study.calibrate import cpu_comparison

    return cpu_comparison(data, "mean")


LONG_GEMM_S = 1e-4  # below this a GEMM's launch dominates, which the roofline leaves out (as it does split-K)


def gemm_check() -> None:
    """The GEMM roofline against each GPU kind's measured or published grid (labkit.study.flops.gemm_check); a grid
    that describes several presets (DeepBench's V100: 16 and 32 GB) is printed once."""
    import pandas as pd

    from labkit.runtime import hardware
    from labkit.study import flops

    seen: set[str] = set()
    for kind in hardware.GPUS.values():
        rows = flops.gemm_check(kind)
        if not rows or kind.constants_source in seen:
            continue
        seen.add(kind.constants_source)
        table = pd.DataFrame(rows)
        print(f"\n{kind.name}: GEMM roofline (PREDICTED) against {kind.constants_source}")
        print(table[["dtype", "label", "m", "n", "k", "measured_s", "predicted_s", "error", "calibrates"]].to_string(
            index=False, float_format=lambda v: f"{v:.3g}"))
        errors = table["error"].abs()
        long = table[table["measured_s"] >= LONG_GEMM_S]["error"].abs()
        print(f"median |error| {errors.median():.1%}, max {errors.max():.1%} over {len(table)} GEMMs; "
              f"{len(long)} GEMMs of >= {LONG_GEMM_S * 1e3:g} ms: median {long.median():.1%}, max {long.max():.1%}")
        for dtype, rate in table[table["calibrates"]].groupby("dtype")["error"]:  # the GEMMs its rate is taken from
            print(f"  {dtype}: the rate is the median of {len(rate)} GEMMs (calibrates), around which their |error| "
                  f"has median {rate.abs().median():.1%}, max {rate.abs().max():.1%}")


def main() -> int:
    import pandas as pd

    from labkit.study import published

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="re-measure the CPU runs into data/predict-ci first")
    parser.add_argument("--measure-zero3-ranks", action="store_true",
                        help="re-measure ZeRO-3's host work at 1, 2, 4 and 8 ranks into zero3_ranks.json first")
    parser.add_argument("--out", default=str(DATA))
    parser.add_argument("--points", default=None, help="a CSV of published points in data/published/points.csv's "
                        "columns (data/published/README.md), checked alone; default: that file, then every check")
    args = parser.parse_args()
    if args.points is not None and (args.measure or args.measure_zero3_ranks):
        parser.error("--points checks a file alone; --measure and --measure-zero3-ranks are for the whole check")
    try:
        points = published.load(args.points)  # every bad cell named before anything is predicted
    except (OSError, ValueError) as err:
        print(f"bench_predict: {err}", file=sys.stderr)
        return 2
    pd.set_option("display.width", 200)
    if args.measure:
        measure(Path(args.out))
    if args.measure_zero3_ranks:
        from labkit.study.calibrate import measure_zero3_rank_scaling

        ranks = measure_zero3_rank_scaling()
        (Path(args.out) / "zero3_ranks.json").write_text(json.dumps(ranks, indent=2) + "\n")
        print("ZeRO-3 host work per module per micro-step (CPU time, this machine): "
              + ", ".join(f"{n} rank(s) {t * 1e3:.3f} ms" for n, t in ranks["per_module_s"].items())
              + f"; gather path {ranks['per_fetch_s'] * 1e6:.1f} us per fetch + "
              f"{ranks['per_rank_per_param_fetch_s'] * 1e6:.2f} us per rank per gathered parameter")
    table = published.compare(points)
    print("Published GPU points: predicted / published (every figure on the predicted side is PREDICTED)")
    print(table[["point_id", "gpu", "gpus", "strategy", "micro_batch", "metric", "published", "predicted",
                 "error", "error_if_nothing_hides", "fits"]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    s = published.summary(table)
    print(f"median |error| {s['median_abs_error']:.1%} (goal <= 25%), max {s['max_abs_error']:.1%} (goal <= 40%); "
          f"{s['points']} points, {s['sources']} sources, {s['gpu_kinds']} GPU kinds")
    hides = table[table["predicted_if_nothing_hides"] != table["predicted"]]
    if len(hides):  # the model hides some communication there: the same steps with none hidden, for comparison
        print(f"where the model hides communication behind compute ({len(hides)} points): median |error| "
              f"{hides['error'].abs().median():.1%}, max {hides['error'].abs().max():.1%}; with none hidden "
              f"(error_if_nothing_hides, not the goal's) {hides['error_if_nothing_hides'].abs().median():.1%}, "
              f"{hides['error_if_nothing_hides'].abs().max():.1%}")
    overflow = table.loc[~table["fits"], "point_id"].tolist()
    if overflow:  # they ran, so the memory model is high for them; the step is predicted all the same
        print(f"the memory model says {len(overflow)} of them do not fit, though they ran: {', '.join(overflow)}")
    if args.points is not None:  # the other checks do not depend on the file
        return 0
    gemm_check()
    if (Path(args.out) / "runs.csv").exists():
        cpu = cpu_check(Path(args.out))
        print("\nThis machine: 2-rank points predicted from 1-rank runs (PREDICTED / measured; each run's mean step)")
        print(cpu.to_string(index=False, float_format=lambda v: f"{v:.4g}"))  # type: ignore[attr-defined]
        errors = cpu["error"].abs()  # type: ignore[index]
        print(f"median |error| {statistics.median(errors):.1%} (goal <= 15%), max {max(errors):.1%} (goal <= 30%)")
    from labkit.study.calibrate import gpu_comparison

    gpu = gpu_comparison(ROOT / "data")
    if gpu is not None:
        from labkit.study.predict import TINY_STEP_S

        print("\nThe lab's runs on a GPU: median step PREDICTED from the config / measured (one rank; under "
              f"{TINY_STEP_S * 1e3:.0f} ms a predicted step is launch-bound, which the model predicts short), and "
              "PREDICTED calibrated on the same strategy's run at another micro-batch (labkit predict --from: the "
              "miss read as fixed work, and as a slower device)")
        print(gpu.to_string(index=False, float_format=lambda v: f"{v:.4g}"))  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
