"""Warm launches against the bare launchers and against cold launches: the Launch button -> the first plotted point.

    .venv/bin/python benchmarks/bench_warm_launch.py [--triples 3] [--examples zero3,pytorch] [--json out.json]

Goals it serves (issue 25, item 3), as ratios measured in one run: Launch -> first plotted point <= 0.3x the bare
`deepspeed` launcher's start -> first step of the same training (Example 3, ZeRO-3 on 2 CPU ranks), and the same for
a plain PyTorch run (Example 1, one process) against `python train.py`. Each triple runs, one after another:
- warm: `LabPanel.launch()` with the "cold launch" box unticked (the default on CPU): the supervisor and ranks forked
  from the zygote (labkit/launch/zygote.py), timed to the dashboard refresh that plots rank 0's first step;
- bare: the same training as a user writes it, no labkit (benchmarks/launch_twins.py: `python -m
  deepspeed.launcher.runner --num_gpus 2 train.py ...`, or `python train.py`), timed to rank 0's first optimizer
  step (bench_launch.py's `bare_run`);
- cold: the panel with the box ticked, through DeepSpeed's launcher as the bare run.
The zygote is started and waited for before the first triple, as the panel does when it is shown (its preload is
printed: once per kernel). The ratios are medians of the triples' own ratios. bench_launch.py splits the cold
launch into its phases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launch import bare_run, example_config
from launch_twins import RunFailed, first_point_panel

from labkit.launch import zygote
from labkit.launch.run import warm_up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triples", type=int, default=3)
    parser.add_argument("--examples", default="zero3,pytorch", help="comma-separated, of zero3, pytorch")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    os.environ.pop(zygote.SHARED_ENV, None)  # this process's own zygote, as a kernel's
    lent = warm_up()
    assert lent is not None, "warm launches are off here (LABKIT_WARM=0, or a GPU machine)"
    ready = lent.wait_ready()
    result: dict[str, Any] = {"zygote_preload_s": ready["preload_s"], "loadavg_start": os.getloadavg(),
                              "examples": {}}
    print(f"zygote preload {ready['preload_s']:.1f} s (once per kernel); load {os.getloadavg()[0]:.2f}; "
          f"runs in {workdir}", flush=True)
    for example in args.examples.split(","):
        config = example_config(example)
        times: dict[str, list[float]] = {"warm": [], "bare": [], "cold": []}
        for triple in range(args.triples):
            try:
                warm = first_point_panel(config, workdir / "runs", cold=False)["total"]
                bare = bare_run(config, workdir)["total"]
                cold = first_point_panel(config, workdir / "runs", cold=True)["total"]
            except RunFailed as exc:
                print(f"  {example} triple {triple + 1}: skipped, {exc}", flush=True)
                continue
            if bare is None:
                print(f"  {example} triple {triple + 1}: skipped, the bare run's first step was not seen", flush=True)
                continue
            for side, value in (("warm", warm), ("bare", bare), ("cold", cold)):
                times[side].append(value)
            print(f"  {example} triple {triple + 1}: warm {warm:.2f} s, bare {bare:.2f} s, cold {cold:.2f} s",
                  flush=True)
        if not times["warm"]:
            continue
        ratios = {"warm_over_bare": statistics.median(w / b for w, b in zip(times["warm"], times["bare"], strict=True)),
                  "cold_over_bare": statistics.median(c / b for c, b in zip(times["cold"], times["bare"], strict=True)),
                  "warm_over_cold": statistics.median(w / c for w, c in zip(times["warm"], times["cold"], strict=True))}
        medians = {side: statistics.median(values) for side, values in times.items()}
        result["examples"][example] = {"config": config.to_dict(), "times_s": times, "median_s": medians, **ratios}
        bare_name = "python train.py" if example == "pytorch" else "deepspeed launcher"
        print(f"{example}: Launch -> first plotted point, median of {len(times['warm'])}: "
              f"warm {medians['warm']:.2f} s, cold {medians['cold']:.2f} s; "
              f"bare ({bare_name}) start -> first step {medians['bare']:.2f} s")
        print(f"  warm / bare {ratios['warm_over_bare']:.2f}x (goal <= 0.3x), cold / bare "
              f"{ratios['cold_over_bare']:.2f}x, warm / cold {ratios['warm_over_cold']:.2f}x", flush=True)
    result["loadavg_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
