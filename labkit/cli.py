"""Command line: the same runs as the notebooks, for CI, scripts and clusters.

    python -m labkit run --example zero3 --world-size 2 --micro-batch 64 --steps 20
    python -m labkit export --example zero3 --world-size 16 --hostfile hosts --launcher pdsh --out job/
    python -m labkit runs
    python -m labkit answer --profile ci      # sweep + max-batch search + report (labkit.study.answer)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from labkit.core.config import EXAMPLES, LR_SCALINGS, OPTIMIZERS, PRECISIONS, ConfigError, RunConfig

# RunConfig fields exposed as flags: --micro-batch for micro_batch, and so on.
_FLAG_FIELDS = ("model", "data", "loss", "stage", "precision", "world_size", "micro_batch", "grad_accum",
                "train_batch", "steps", "optimizer", "lr", "lr_scaling", "base_batch", "warmup_steps", "warmup_samples",
                "input_size", "hidden", "depth", "output_size", "dataset_size", "seed", "target_loss", "eval_every",
                "eval_samples", "threads_per_rank", "heartbeat_s", "startup_timeout_s", "device_memory_budget_bytes",
                "census_every", "noise_scale_every", "hostfile")
_HELP = {
    "model": "what to train: 'mlp', 'gpt' (byte-level GPT-2 on Python's source, needs [hf]) or "
             "'package.module:build_model' (build_model(config) -> torch.nn.Module)",
    "data": "'package.module:build_dataset' (build_dataset(config) -> Dataset of (inputs, labels)); "
            "default: the built-in model's",
    "loss": "'package.module:loss_fn' (loss_fn(model, inputs, labels) -> scalar tensor); default: cross-entropy",
    "stage": "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters partitioned",
    "precision": "fp32, bf16 or fp16 (fp16 needs a GPU)",
    "world_size": "ranks: one per GPU, or CPU processes",
    "micro_batch": "samples per rank per forward/backward",
    "grad_accum": "micro-batches per optimizer step",
    "train_batch": "global batch; must equal micro_batch x grad_accum x world_size",
    "steps": "optimizer steps (script mode: the progress bar's length)",
    "optimizer": "adam or sgd",
    "lr": "learning rate at --base-batch",
    "lr_scaling": "how the LR follows the global batch: none, linear, sqrt",
    "input_size": "MLP input features; GPT context length in bytes",
    "hidden": "MLP width; GPT n_embd",
    "depth": "MLP hidden layers; GPT n_layer",
    "warmup_samples": "linear LR warmup over this many samples (the same data at every batch size)",
    "target_loss": "record the time this loss is first reached (on the held-out eval loss with --eval-every)",
    "eval_every": "evaluate the held-out loss every N steps (0: off)",
    "eval_samples": "size of the held-out evaluation set",
    "threads_per_rank": "CPU ranks: OpenMP threads each (default: cores / ranks)",
    "hostfile": "multi-node: DeepSpeed hostfile ('host slots=N' lines)",
    "base_batch": "the global batch --lr was tuned for (--lr-scaling scales from it)",
    "warmup_steps": "linear LR warmup over this many optimizer steps (or --warmup-samples, not both)",
    "output_size": "MLP classes (the GPT's vocabulary is always 256 bytes)",
    "dataset_size": "training samples (GPT: windows of --input-size bytes)",
    "seed": "initial weights, data order and the built-in datasets",
    "heartbeat_s": "a rank silent this long after its first step is reported hung",
    "startup_timeout_s": "allowance for process start and DeepSpeed's JIT op builds",
    "device_memory_budget_bytes": "emulated device capacity per rank (CPU); passing it is an out-of-memory failure",
    "census_every": "recount model-state bytes every N steps",
    "noise_scale_every": "estimate the gradient noise scale every N steps (0: off)",
}
_SLURM_FLAGS = ("nodes", "partition", "time", "gpus_per_node", "account")  # labkit.launch.export.SlurmOptions
_CHOICES = {"stage": (0, 1, 2, 3), "precision": PRECISIONS, "optimizer": OPTIMIZERS, "lr_scaling": LR_SCALINGS}
_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    parser.add_argument("--example", choices=EXAMPLES, default=None,
                        help="pytorch: plain PyTorch loop, 1 process; deepspeed: DeepSpeed's engine, give --stage; "
                             "offload: ZeRO-2 + optimizer offload; zero3: ZeRO stage 3 (required unless --script)")
    for name in _FLAG_FIELDS:
        kind = _TYPES.get(str(fields[name].type), str)
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                            choices=_CHOICES.get(name),
                            help=_HELP.get(name, f"RunConfig.{name}") + f" (default: {fields[name].default})")
    parser.add_argument("--offload-optimizer", dest="offload_optimizer", action=argparse.BooleanOptionalAction,
                        default=None, help="optimizer state and step on the CPU (ZeRO stages 1-3)")
    parser.add_argument("--no-distributed-sampler", dest="distributed_sampler", action="store_false", default=None,
                        help="reproduce the seed text's bug: every rank reads the whole dataset")
    parser.add_argument("--stop-at-target", dest="stop_at_target", action="store_true", default=None,
                        help="end the run once --target-loss is reached")
    parser.add_argument("--no-telemetry", dest="telemetry", action="store_false", default=None,
                        help="write only start/done records (benchmark baseline)")
    parser.add_argument("--comms-log", dest="comms_log", action="store_true", default=None,
                        help="record what DeepSpeed's collectives sent, per rank, into comms_rank<N>.json "
                             "(DeepSpeed's comms logger; it makes every collective blocking on a GPU: not for timing)")
    parser.add_argument("--ds-override", dest="ds_overrides", action="append", default=None, metavar="JSON",
                        help='extra DeepSpeed config, e.g. \'{"gradient_clipping": 1.0}\' (checked by DeepSpeed\'s own '
                             'config; a key it never reads is refused)')


def config_from_args(args: argparse.Namespace) -> RunConfig:
    script = getattr(args, "script", None)
    if args.example is None and not script:
        raise ConfigError("example", f"--example is required ({', '.join(EXAMPLES)}), or --script")
    values: dict[str, Any] = {"example": args.example or "zero3"}
    if script:
        values.update(script=script, script_args=list(getattr(args, "script_args", None) or []))
    for name in (*_FLAG_FIELDS, "offload_optimizer", "distributed_sampler", "stop_at_target", "telemetry",
                 "comms_log"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.ds_overrides:
        overrides: dict[str, Any] = {}
        for text in args.ds_overrides:
            try:
                overrides.update(json.loads(text))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ConfigError("ds_overrides", f"--ds-override is not a JSON object: {text!r} ({exc})") from None
        values["ds_overrides"] = overrides
    return RunConfig.from_dict(values)


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from labkit.launch.admission import Admission
    from labkit.launch.phase import RunProgress, run_label
    from labkit.launch.run import Run

    config = config_from_args(args)
    admission = Admission.here()
    estimate, decision = admission.admit_alone(config, "this run")  # NotEnoughMemory: exit 2, with the figures
    if not decision.admit:  # other programs hold the memory now
        print(f"{decision.describe()}; waiting for other programs to free it (Ctrl-C gives up)", file=sys.stderr)
        try:
            while not admission.decide(estimate, []).admit:
                time.sleep(1.0)
        except KeyboardInterrupt:
            return 130
    run = Run(config, out=args.out, launcher=args.launcher).start()
    run_dir = run.run_dir
    assert run_dir is not None  # start() made it
    print(f"run directory: {run_dir}", file=sys.stderr)
    bar = tqdm(total=config.steps, unit="step", desc=f"{run_label(config)} x{config.world_size}", file=sys.stderr)
    watcher = RunProgress(run)
    try:
        while not run.done:
            progress, phase = watcher.poll()
            bar.set_postfix_str(phase, refresh=False)
            bar.update(progress - bar.n)
            admission.sample(run._supervisor_pid())  # the launchers' RSS, learned below
            run.wait(timeout=0.5)
    except KeyboardInterrupt:
        print("\nstopping the run ...", file=sys.stderr)
        run.stop()
    run.recover()  # its supervisor died (`done` reads so): end what it left, write the summary
    bar.update(run.progress() - bar.n)
    bar.close()
    admission.learn(config, run.run_dir, run._supervisor_pid())
    summary = run.summary or {}
    for warning in summary.get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)
    if run.status == "finished":
        step_time, rate = summary.get("median_step_time_s"), summary.get("samples_per_s")
        if config.script:  # the script's batch is its own: no samples/s
            timing = (f", median step {step_time:.4f} s" if step_time
                      else " (no per-step records: the script calls no labkit.record; memory was sampled)")
        else:
            timing = (f", median step {step_time:.4f} s, {rate:.1f} samples/s" if step_time and rate
                      else " (no per-step records: telemetry was off)")
        print(f"finished: {summary.get('steps_completed')} steps{timing}; {run.run_dir}/summary.json")
        return 0
    print(f"{run.status}: {run.cause}\nsee {run.run_dir}", file=sys.stderr)
    return {"oom": 3, "hung": 4, "stopped": 130}.get(run.status, 1)


def cmd_export(args: argparse.Namespace) -> int:
    """Write a self-contained job directory for DeepSpeed's multi-node launcher (labkit.launch.export)."""
    from labkit.core.config import without_local_device_checks
    from labkit.launch.export import SlurmOptions, write_job

    with without_local_device_checks():  # a login node need not have the cluster's GPUs
        config = config_from_args(args)
    given = {name: getattr(args, name) for name in _SLURM_FLAGS if getattr(args, name) is not None}
    slurm = SlurmOptions(**given) if args.launcher == "slurm" else None
    if given and slurm is None:
        raise ConfigError("launcher", f"--{', --'.join(n.replace('_', '-') for n in given)}: Slurm's options, for "
                          "--launcher slurm")
    names = write_job(config, args.out, launcher=args.launcher, master_port=args.master_port, slurm=slurm)
    out = Path(args.out).resolve()
    print(f"wrote {out}: {', '.join(names)}")
    if args.launcher == "slurm":
        script = (out / "launch.sh").read_text().splitlines()
        print("\n".join(line for line in script if line.startswith("#SBATCH")))
        print(f"submit it with: sbatch {out / 'launch.sh'}")
    else:
        print(f"run it with: {out / 'launch.sh'}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from labkit.launch.history import recover_stale, runs

    recover_stale(args.root)  # runs whose supervisor died: end what it left, so none is listed as running
    table = runs(args.root)
    if args.format == "csv":
        sys.stdout.write(table.to_csv(index=False))
    elif args.format == "json":
        sys.stdout.write(table.to_json(orient="records", indent=2) + "\n")
    else:
        print(table.to_string(index=False) if len(table) else "no runs yet")
    return 0


def cmd_export_metrics(args: argparse.Namespace) -> int:
    """A finished run's per-step records as TensorBoard event files and/or CSV (labkit.launch.export_metrics)."""
    from labkit.launch.export_metrics import to_csv, to_tensorboard

    if not (args.tensorboard or args.csv):
        raise ConfigError("export-metrics", "name at least one of --tensorboard DIR, --csv DIR")
    if not Path(args.run).is_dir():
        raise ConfigError("run", f"no such run directory: {args.run}")
    written = (to_tensorboard(args.run, args.tensorboard) if args.tensorboard else []) + \
        (to_csv(args.run, args.csv) if args.csv else [])
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """Predicted step time on hardware this machine does not have, or calibrated on a finished run
    (labkit.study.predict)."""
    from labkit.study.predict_cli import cli

    return cli(args)


def cmd_answer(args: argparse.Namespace) -> int:
    """Max-batch search + batch-size sweep + report (labkit.study.answer)."""
    from labkit.study.answer import cli

    return cli(args)


EPILOG = """examples:
  labkit run --example zero3 --world-size 2 --micro-batch 64 --steps 20
  labkit run --example zero3 --world-size 2 --model gpt --hidden 64 --depth 2 --input-size 64
  labkit run --example offload --world-size 2 --model my_pkg.train:build_model --data my_pkg.train:build_dataset
  labkit run --script train.py --world-size 2 -- --deepspeed_config ds.json
  labkit export-metrics runs/<run> --tensorboard tb/ --csv csv/
  labkit answer --profile ci --model gpt --strict
  labkit runs --format csv
  labkit predict --transformer layers=48,hidden=1600,heads=16,seq=1024 --gpu V100-32GB --gpus-per-node 16 \
      --nodes 4 --intra nvswitch --inter-gbps 800 --stage 1 --micro-batch 8 --global-batch 2048 --format json
  labkit predict --from runs/<a 1-rank run> --world-size 2

exit codes:
  0 finished   1 failed (cause printed; answer --strict: a point did not finish)   2 bad arguments or config
  3 out of memory   4 hung (no progress within the heartbeat)   130 stopped (Ctrl-C)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="DeepSpeed Batch Lab: real DeepSpeed runs, "
                                     "supervised, with per-rank records", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each subcommand's --help ends with the examples and exit codes too.
    tail: dict[str, Any] = dict(epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = sub.add_parser("run", **tail, help="launch one supervised run and wait for it")
    _add_config_flags(run)
    run.add_argument("--out", default=None, help="run directory (default: a new one under runs/)")
    run.add_argument("--launcher", choices=("pdsh", "openmpi"), default="pdsh",
                     help="with --hostfile: DeepSpeed's multi-node launcher, pdsh over ssh or Open MPI's mpirun "
                          "(Slurm: labkit export --launcher slurm, then sbatch)")
    run.add_argument("--script", default=None, metavar="TRAIN.PY",
                     help="script mode: run this unmodified DeepSpeed script on every rank (arguments after --)")
    run.set_defaults(func=cmd_run)
    export = sub.add_parser("export", **tail, help="write a multi-node job directory (launch.sh, ds_config.json, ...)")
    _add_config_flags(export)
    export.add_argument("--out", required=True, help="job directory, on a filesystem every node shares")
    export.add_argument("--launcher", choices=("pdsh", "openmpi", "slurm"), default="pdsh",
                        help="DeepSpeed's multi-node launcher (its runner's --launcher); slurm: no --hostfile, "
                             "Slurm picks the nodes (--nodes)")
    export.add_argument("--master-port", type=int, default=None,
                        help="rank 0's rendezvous port (default: 29500; slurm: a free port on the first node, "
                             "chosen when the job starts)")
    slurm = export.add_argument_group("Slurm (--launcher slurm): launch.sh's #SBATCH lines")
    slurm.add_argument("--nodes", type=int, default=None, help="nodes; the ranks are split evenly (default: 1)")
    slurm.add_argument("--partition", default=None, help="partition (default: the cluster's default partition)")
    slurm.add_argument("--time", default=None, help="time limit: minutes, HH:MM:SS or D-HH:MM:SS (default: 01:00:00)")
    slurm.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=None,
                       help="--gres=gpu:N per node (default: one per rank on the node; 0: CPU ranks, no --gres)")
    slurm.add_argument("--account", default=None, help="account to charge (default: yours)")
    export.set_defaults(func=cmd_export)
    runs = sub.add_parser("runs", **tail, help="list past runs")
    runs.add_argument("--root", default=None, help="run store (default: LABKIT_RUNS_DIR, else runs/)")
    runs.add_argument("--format", choices=("table", "csv", "json"), default="table",
                      help="table: for people; csv / json: one row / object per run, for scripts")
    runs.set_defaults(func=cmd_runs)
    metrics = sub.add_parser("export-metrics", **tail, help="a run's per-step records as TensorBoard events and/or CSV")
    metrics.add_argument("run", help="run directory (runs/<name>)")
    metrics.add_argument("--tensorboard", default=None, metavar="DIR", help="write DIR/rank<N>/ event files")
    metrics.add_argument("--csv", default=None, metavar="DIR", help="write DIR/rank<N>.csv")
    metrics.set_defaults(func=cmd_export_metrics)
    answer = sub.add_parser("answer", **tail, help="batch-size sweep, max-batch search, time to target, report")
    # labkit.study.answer.PROFILES' names (not imported here: it pulls in pandas and the sweep).
    answer.add_argument("--profile", choices=("ci", "workshop", "full", "smoke"), default=None,
                        help="default: LABKIT_PROFILE, else by device; workshop: one node of 16-24 GB GPUs; "
                             "smoke: a minutes-long end-to-end check")
    answer.add_argument("--out", default=None, help="results + run directories (default: runs/answer-<profile>)")
    answer.add_argument("--parallel", type=int, default=None,
                        help="timed runs at once (default and maximum: as many as share no core or device)")
    answer.add_argument("--reference", default=None, help="also copy the CSVs, machine.json and report here")
    answer.add_argument("--strict", action="store_true",
                        help="exit 1 when a sweep point did not finish (CI); default: report it and exit 0")
    for name in ("model", "data", "loss"):
        answer.add_argument("--" + name, default=None, help=_HELP[name] + " (default: the profile's MLP)")
    answer.set_defaults(func=cmd_answer)
    _add_predict_parser(sub.add_parser("predict", **tail, help="PREDICTED step time on GPUs you don't have, or on "
                                       "another world size / micro-batch / stage calibrated on a finished run"))
    return parser


def _add_predict_parser(predict: argparse.ArgumentParser) -> None:
    what = predict.add_mutually_exclusive_group(required=True)
    what.add_argument("--transformer", metavar="SPEC", help="a GPT-2-style model by its shape: "
                      "layers=48,hidden=1600,heads=16,seq=1024[,vocab=50257]")
    what.add_argument("--model", help="a lab model: 'mlp', 'gpt' or 'package.module:build_model' (counted on the "
                      "meta device; sized by --hidden/--depth/--input-size)")
    what.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                      help="calibrate on a finished run and predict it at another --world-size/--micro-batch/--stage")
    for name in ("hidden", "depth", "input_size"):
        predict.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=_HELP[name])
    predict.add_argument("--gpu", default="A100-80GB",
                         help="GPU kind (labkit.study.predict.HARDWARE; default A100-80GB)")
    predict.add_argument("--gpus-per-node", type=int, default=1, help="GPUs in one node (default 1)")
    predict.add_argument("--nodes", type=int, default=1, help="nodes (default 1); several need --inter-gbps")
    predict.add_argument("--intra", default="auto", help="link inside a node: nvlink2, nvlink3, nvlink4, nvswitch "
                         "(the NVSwitch of the GPU's generation), pcie3, pcie4, pcie5; auto (default): NVSwitch "
                         "where the GPU has NVLink, else its PCIe")
    predict.add_argument("--inter-gbps", type=float, default=0.0,
                         help="the node's total network bandwidth in Gb/s (8 HDR links: 1600; one EDR: 100)")
    predict.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default 0)")
    predict.add_argument("--plain-pytorch", action="store_true", help="plain PyTorch DDP instead of DeepSpeed")
    predict.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload (stages 1-3)")
    predict.add_argument("--micro-batch", type=int, default=None, help="samples per GPU per forward/backward")
    predict.add_argument("--global-batch", type=int, default=None, help="sets the accumulation: micro x accum x GPUs")
    predict.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step (or --global-batch)")
    predict.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None, help="default fp16")
    predict.add_argument("--activation-checkpointing", action="store_true", help="recompute the forward in backward")
    predict.add_argument("--host-memory-gb-per-s", type=float, default=None,
                         help="a node's host memory bandwidth for CPU Adam (default 256: 2 sockets x 6 DDR4-2666)")
    predict.add_argument("--b-crit", type=float, default=None, help="critical batch for time to the same loss")
    predict.add_argument("--results", default=None, help="an answer's results dir: B_crit from its noise.csv")
    predict.add_argument("--card", action="store_true", help="print the predicted answer card (both ways to grow "
                         "the batch, per step, per epoch, to the same loss)")
    predict.add_argument("--world-size", type=int, default=None, help="--from: ranks to predict")
    predict.add_argument("--threads-per-rank", type=int, default=None, help="--from: CPU threads per rank")
    predict.add_argument("--links", default=None, metavar="JSON",
                         help="--from: a saved link fit (default: measure_links on this machine, ~30 s)")
    predict.add_argument("--format", choices=("table", "json"), default="table",
                         help="table: for people; json: every key (step_time_s, samples_per_s, ...), for scripts")
    predict.set_defaults(func=cmd_predict)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Script mode: everything after the first "--" belongs to the script.
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.script_args = script_args
    try:
        return args.func(args)
    except (ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
