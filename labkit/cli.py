"""Command line: the same runs as the notebooks, for CI, scripts and clusters.

    python -m labkit run --example zero3 --world-size 2 --micro-batch 64 --steps 20
    python -m labkit export --example zero3 --world-size 16 --hostfile hosts --launcher pdsh --out job/
    python -m labkit runs
    python -m labkit answer --profile ci      # sweep + max-batch search + report (labkit.study.answer)
    python -m labkit report runs/answer-ci    # its card and report again from its tables, nothing measured
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from labkit.core.config import FIELDS, GROUPS, ConfigError, RunConfig
from labkit.runtime.ops import OPTIMIZER_IMPLS

_SLURM_FLAGS = ("nodes", "partition", "time", "gpus_per_node", "account")  # labkit.launch.export.SlurmOptions
# What a script run (--script) takes from labkit's config: its ranks, where and with how many threads they run,
# the progress bar's length and when a rank counts as hung. The learner's script builds its own model, data, batch,
# optimizer and DeepSpeed config, and labkit's worker (telemetry, evaluation, census, memory budget) does not run.
_SCRIPT_FIELDS = ("world_size", "hostfile", "threads_per_rank", "steps", "heartbeat_s", "startup_timeout_s",
                  "comms_log")  # comms_log: RunConfig refuses it in script mode, saying why


def flag(name: str) -> str:
    """The CLI's flag for RunConfig field `name`: --micro-batch for micro_batch."""
    return "--" + name.replace("_", "-")


def _given_flag(name: str, value: Any) -> str:
    """The flag as it was typed for RunConfig field `name` set to `value`: --no-telemetry for telemetry False."""
    spec = FIELDS[name]
    negated = spec.kind is bool and value is False and (spec.optional or bool(spec.default))
    return "--no-" + name.replace("_", "-") if negated else flag(name)


def _flag_help(name: str) -> str:
    """A field's help as the CLI shows it: the fields it names written as their flags."""
    return FIELDS[name].describe(lambda ref: flag(ref) if ref in FIELDS and FIELDS[ref].cli else ref)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field the CLI sets (`cli` in its metadata), in the fields' groups: name, type,
    choices and help from the field. Every default is None, so config_from_args passes only what was given."""
    groups = {group: parser.add_argument_group(f"{group} (RunConfig)") for group in GROUPS}
    for name, spec in FIELDS.items():
        if not spec.cli:
            continue
        group, text = groups[spec.group], _flag_help(name)
        if name == "example":  # RunConfig's default is for Python; the command line asks
            group.add_argument(flag(name), choices=spec.choices, default=None,
                               help=text + " (required unless --script)")
        elif spec.kind is bool and spec.optional:  # unset: the example's preset
            group.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        elif spec.kind is bool:  # the flag turns the default around
            negated = "--no-" + name.replace("_", "-") if spec.default else flag(name)
            group.add_argument(negated, dest=name, action="store_false" if spec.default else "store_true",
                               default=None, help=text)
        else:
            kind = type(spec.choices[0]) if spec.choices else spec.kind
            default = "" if spec.default is None else f" (default: {spec.default})"  # None: the help says
            group.add_argument(flag(name), dest=name, type=kind, default=None, choices=spec.choices,
                               help=text + default)
    # Not one value each: repeated JSON objects, merged.
    groups["strategy"].add_argument("--ds-override", dest="ds_overrides", action="append", default=None,
                                    metavar="JSON", help=_flag_help("ds_overrides"))


def config_from_args(args: argparse.Namespace) -> RunConfig:
    script = getattr(args, "script", None)
    if args.example is None and not script:
        raise ConfigError("example", f"--example is required ({', '.join(FIELDS['example'].choices or ())}), "
                          "or --script")
    if script:
        ignored = [name for name, spec in FIELDS.items()
                   if spec.cli and name not in _SCRIPT_FIELDS and getattr(args, name, None) is not None]
        if ignored:
            given = ", ".join(_given_flag(name, getattr(args, name)) for name in ignored)
            raise ConfigError(ignored[0], f"{given}: script mode runs the learner's script, "
                              "which builds its own model, data, batch, optimizer and DeepSpeed config; labkit's "
                              f"{'flag' if len(ignored) == 1 else 'flags'} would have no effect (set "
                              f"{'it' if len(ignored) == 1 else 'them'} in the script or its ds_config)")
    values: dict[str, Any] = {"example": args.example or "zero3"}
    if script:
        values.update(script=script, script_args=list(getattr(args, "script_args", None) or []))
    for name in (name for name, spec in FIELDS.items() if spec.cli and name != "example"):
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

    from labkit.launch.admission import Admission, oversubscribed
    from labkit.launch.environment import check_environment
    from labkit.launch.phase import RunProgress, run_label
    from labkit.launch.run import Run

    config = config_from_args(args)
    # LABKIT_WARM, LABKIT_FAULT, ...: refused at once, not after admission's wait (Run.start checks them again)
    check_environment(os.environ, paths=not (config.hostfile or args.launcher != "pdsh"))
    if args.out is not None:  # before admission, which may wait for memory: a bad --out is refused at once
        from labkit.launch.store import check_output_dir

        out = check_output_dir(args.out, "--out")
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError("out", f"--out directory {out} is not empty")
    admission = Admission.here()
    estimate, decision = admission.admit_alone(config, "this run")  # NotEnoughMemory: exit 2, with the figures
    if admission.is_cpu and (warning := oversubscribed(config, estimate, admission.cores)):
        print(f"warning: {warning}", file=sys.stderr)
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
    from labkit.launch.store import check_output_dir

    with without_local_device_checks():  # a login node need not have the cluster's GPUs
        config = config_from_args(args)
    check_output_dir(args.out, "--out")
    from labkit.launch.environment import check_environment

    check_environment(os.environ, paths=False)  # what .deepspeed_env carries to the cluster: refused here
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

    # A --root given is the store the user means: missing or a file, it is a typo, not "no runs yet" (as the
    # default root is before the first run).
    if args.root is not None and not (args.root.strip() and Path(args.root).is_dir()):  # "": not the cwd
        what = ("is an empty path" if not args.root.strip() else "is a file, not a run store"
                if Path(args.root).exists() else "does not exist")
        raise ConfigError("root", f"--root {args.root!r} {what}: name the run store's directory (default: "
                          "LABKIT_RUNS_DIR, else runs/)")
    from labkit.launch.store import default_root

    default_root()  # a LABKIT_RUNS_DIR at a file, or under one, is refused there; missing, it holds no runs yet
    recover_stale(args.root)  # runs whose supervisor died: end what it left, so none is listed as running
    table = runs(args.root)
    if args.format == "csv":
        sys.stdout.write(table.to_csv(index=False))
    elif args.format == "json":
        sys.stdout.write(table.to_json(orient="records", indent=2) + "\n")
    else:
        print(table.to_string(index=False, na_rep="") if len(table) else "no runs yet")
    return 0


def cmd_export_metrics(args: argparse.Namespace) -> int:
    """A finished run's per-step records as TensorBoard event files and/or CSV (labkit.launch.export_metrics)."""
    from labkit.launch.export_metrics import rank_ids, to_csv, to_tensorboard
    from labkit.launch.store import check_output_dir

    if not (args.tensorboard or args.csv):
        raise ConfigError("export-metrics", "name at least one of --tensorboard DIR, --csv DIR")
    if not args.run.strip():
        raise ConfigError("run", "the run directory is an empty path: name runs/<run>")
    if not Path(args.run).is_dir():
        raise ConfigError("run", f"no such run directory: {args.run}")
    if not rank_ids(args.run):
        raise ConfigError("run", f"{args.run} is not a run directory: it holds no rank records (rank<N>.jsonl)")
    for name in ("tensorboard", "csv"):  # before anything is written: no output dir is left behind
        if getattr(args, name) is not None:
            check_output_dir(getattr(args, name), f"--{name}")
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


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild an answer's card and report from its tables, measuring nothing (labkit.study.answer)."""
    from labkit.study.answer import report_cli

    return report_cli(args)


EPILOG = """examples:
  labkit run --example zero3 --world-size 2 --micro-batch 64 --steps 20
  labkit run --example zero3 --world-size 2 --model gpt --hidden 64 --depth 2 --input-size 64
  labkit run --example offload --world-size 2 --model my_pkg.train:build_model --data my_pkg.train:build_dataset
  labkit run --script train.py --world-size 2 -- --deepspeed_config ds.json
  labkit export-metrics runs/<run> --tensorboard tb/ --csv csv/
  labkit answer --profile ci --model gpt --strict
  labkit report runs/answer-ci
  labkit runs --format csv
  labkit predict --transformer layers=48,hidden=1600,heads=16,seq=1024 --gpu V100-32GB --gpus-per-node 16 \\
      --nodes 4 --intra nvswitch --inter-gbps 800 --stage 1 --micro-batch 8 --global-batch 2048 --format json
  labkit predict --gpu A100-40GB --gpus-per-node 2 --stage 2 --micro-batch 4 --precision bf16 --offload-optimizer \\
      --transformer arch=qwen2,layers=36,hidden=2048,heads=16,kv_heads=2,ffn=11008,seq=512,vocab=151936,tied=1
  labkit predict --model my_pkg.train:build_model --data my_pkg.train:build_dataset --gpu H100-SXM --micro-batch 32
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
                     help=_flag_help("script") + " (its arguments: everything after --)")
    _add_cold_flag(run)
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
                        help="default: LABKIT_PROFILE, else by device; workshop: one node of 12-70 GiB GPUs or one "
                             "80 GB GPU; full: 2+ 80 GB GPUs; smoke: a minutes-long end-to-end check")
    answer.add_argument("--out", default=None, help="results + run directories (default: runs/answer-<profile>)")
    answer.add_argument("--parallel", type=int, default=None,
                        help="timed runs at once (default and maximum: as many as share no core or device)")
    answer.add_argument("--reference", default=None, help="also copy the CSVs, machine.json and report here")
    answer.add_argument("--strict", action="store_true",
                        help="exit 1 when a sweep point did not finish (CI); default: report it and exit 0")
    for name in ("model", "data", "loss"):
        answer.add_argument(flag(name), default=None, help=_flag_help(name) + " (default: the profile's MLP)")
    _add_cold_flag(answer)
    answer.set_defaults(func=cmd_answer)
    report = sub.add_parser("report", **tail, help="rebuild an answer's answer_card.json and report.html from its "
                            "tables with this labkit (nothing is measured)")
    report.add_argument("results", help="an answer's results dir (runs/answer-<profile>, data/reference-ci, ...)")
    report.set_defaults(func=cmd_report)
    _add_predict_parser(sub.add_parser("predict", **tail, help="PREDICTED step time on GPUs you don't have, or on "
                                       "another world size / micro-batch / stage calibrated on a finished run"))
    return parser


def _add_cold_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cold", action="store_true",
                        help="launch every run through DeepSpeed's launcher, as `deepspeed` does (default: CPU runs "
                             "fork their ranks from a process that imported torch and DeepSpeed once, GPU runs' "
                             "supervisor starts their ranks itself; LABKIT_WARM=0)")


def _add_predict_parser(predict: argparse.ArgumentParser) -> None:
    what = predict.add_mutually_exclusive_group(required=True)
    what.add_argument("--transformer", metavar="SPEC", help="a decoder by its shape, GPT-2-style by default: "
                      "layers=48,hidden=1600,heads=16,seq=1024[,vocab=50257][,dropout=0.1]; LLaMA or Qwen2-style: "
                      "arch=llama|qwen2,...,ffn=N[,kv_heads=N][,tied=1]; attention=eager|sdpa (default: eager "
                      "for GPT-2, sdpa, a fused kernel, for the others); or your Hugging Face model's config.json "
                      "(gpt2, llama, qwen2, mistral) and the sequence you train at: hf=path/to/config.json,seq=2048")
    what.add_argument("--model", help="a lab model: 'mlp', 'gpt' or 'package.module:build_model' (counted on the "
                      "meta device; sized by --hidden/--depth/--input-size; your own with --data and --loss)")
    what.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                      help="calibrate on a finished run and predict it at another --world-size/--micro-batch/"
                           "--stage: CPU ranks on this machine, or GPUs (one node of the run's kind; --gpu names "
                           "it for a run before 2026-11-30)")
    for name in ("hidden", "depth", "input_size"):
        predict.add_argument(flag(name), type=int, default=None, help=_flag_help(name))
    for name in ("data", "loss"):  # a --model of your own: a sample to count on, and its loss
        predict.add_argument(flag(name), default=None, help=_flag_help(name))
    predict.add_argument("--gpu", default=None,
                         help="GPU kind (labkit.study.predict.HARDWARE, or a device name as torch prints it, e.g. "
                              "'NVIDIA A100-SXM4-40GB'; default A100-80GB)")
    predict.add_argument("--gpus-per-node", type=int, default=None, help="GPUs in one node (default 1)")
    predict.add_argument("--nodes", type=int, default=None, help="nodes (default 1); several need --inter-gbps")
    predict.add_argument("--intra", default=None, help="link inside a node: nvlink2, nvlink3, nvlink4, nvswitch "
                         "(the NVSwitch of the GPU's generation), pcie3, pcie4, pcie5; auto (default): NVSwitch "
                         "where the GPU has NVLink, else its PCIe")
    predict.add_argument("--inter-gbps", type=float, default=None,
                         help="the node's total network bandwidth in Gb/s, 0.1 to 100,000 (8 HDR links: 1600; "
                         "one EDR: 100)")
    predict.add_argument("--host-cpu", default=None, type=str.lower,
                         help="the nodes' CPU vendor, intel, amd or other (NCCL's network overhead per ring step); "
                         "auto (default): the GPU kind's DGX")
    predict.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default 0)")
    predict.add_argument("--plain-pytorch", action="store_true", help="plain PyTorch DDP instead of DeepSpeed")
    predict.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload (stages 1-3)")
    predict.add_argument("--optimizer", default=None, choices=OPTIMIZER_IMPLS,
                         help="the basic optimizer, as a run records its optimizer_impl: DeepSpeed's fused_adam (its "
                              "default), torch_adam (DeepSpeed's \"torch_adam\": true, labkit's choice on a GPU "
                              "without nvcc; plain PyTorch's default) or torch_sgd (no momentum: no moments held); "
                              "with --offload-optimizer cpu_adam, the only host step modelled")
    predict.add_argument("--micro-batch", type=int, default=None, help="samples per GPU per forward/backward")
    predict.add_argument("--global-batch", type=int, default=None, help="sets the accumulation: micro x accum x GPUs")
    predict.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step (or --global-batch)")
    predict.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None, help="default fp16")
    predict.add_argument("--activation-checkpointing", action="store_true", help="recompute the forward in backward")
    predict.add_argument("--host-memory-gb-per-s", type=float, default=None,
                         help="your nodes' host memory bandwidth, GB/s: ZeRO-Offload's host work as memory traffic "
                              "at it (default: a GPU node host's measured CPU Adam, else 256: 2 sockets x 6 "
                              "DDR4-2666)")
    predict.add_argument("--zero", default=None, metavar="KEY=VALUE,...",
                         help="DeepSpeed zero_optimization settings that are not its defaults, e.g. "
                              "reduce_bucket_size=1e7,overlap_comm=true (checked by DeepSpeed's config model)")
    predict.add_argument("--b-crit", type=float, default=None, help="critical batch for time to the same loss")
    predict.add_argument("--results", default=None, help="an answer's results dir: B_crit from its noise.csv")
    predict.add_argument("--target-loss", type=float, default=None, metavar="NATS",
                         help="--transformer: B_crit from the loss you train to, nats per token (Kaplan et al. "
                              "2020's power law: B_* / L^(1/0.21), B_* = 2e8 tokens; their WebText2 and GPT-2 "
                              "tokens, so an order of magnitude)")
    predict.add_argument("--card", action="store_true", help="print the predicted answer card (both ways to grow "
                         "the batch, per step, per epoch, to the same loss)")
    predict.add_argument("--world-size", type=int, default=None, help="--from: ranks to predict")
    predict.add_argument("--threads-per-rank", type=int, default=None, help="--from: CPU threads per rank")
    predict.add_argument("--links", default=None, metavar="JSON",
                         help="--from: a saved link fit (default: measured on this machine as training meets the "
                         "link, after 0.25-4 ms of compute, the mean call; ~1 min for 2 ranks on 2 cores)")
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
    if script_args and not getattr(args, "script", None):  # else dropped without a word
        print(f"error: script_args: the arguments after '--' ({' '.join(script_args)}) are a --script's, and "
              "no --script was given", file=sys.stderr)
        return 2
    if getattr(args, "cold", False):
        os.environ["LABKIT_WARM"] = "0"  # labkit.launch.run.warm_by_default; the sweep's runs too
    try:
        return args.func(args)
    except (ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
