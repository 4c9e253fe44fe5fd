"""`python -m labkit predict`: the predictor's command line (labkit.cli hands it its parsed arguments), from
flags or from a measured run (`--from RUN_DIR`, calibrated by labkit.study.calibrate)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only the hardware presets at import: the flags are checked before torch and DeepSpeed load (3-7 s), so a wrong
# GPU, link, stage or batch is refused at once; the counting modules are imported where they are used.
from labkit.runtime.hardware import Cluster
from labkit.runtime.hardware import gpu as find_gpu

if TYPE_CHECKING:
    from labkit.core.config import RunConfig
    from labkit.study.predict import Workload
    from labkit.study.shapes import Transformer


def _bad(field_name: str, message: str) -> Exception:
    from labkit.core.config import ConfigError

    return ConfigError(field_name, message)


DEFAULT_GPU = "A100-80GB"
# The flags each way of predicting reads (the parser's defaults are None or False, so a flag given is one set):
# a flag the chosen way does not read is refused, not ignored.
FLAGS_FOR_SHAPES = ("gpu", "gpus_per_node", "nodes", "intra", "inter_gbps", "host_cpu", "plain_pytorch",
                    "offload_optimizer", "optimizer", "global_batch", "grad_accum", "precision",
                    "activation_checkpointing", "host_memory_gb_per_s", "zero", "b_crit", "results", "target_loss",
                    "card")
FLAGS_FOR_LAB_MODELS = ("hidden", "depth", "input_size", "data", "loss")
FLAGS_FOR_RUNS = ("world_size", "threads_per_rank", "links")


def _refuse_unread(args: Any) -> None:
    """Exit 2 naming every flag the chosen way (--transformer, --model or --from) does not read."""
    def given(names: tuple[str, ...]) -> list[str]:
        # unset: None (values) or False (switches); a value of 0 is a flag given
        return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None
                and getattr(args, n) is not False]

    if args.from_run is not None:
        unread, why = given(tuple(f for f in FLAGS_FOR_SHAPES if f != "gpu") + FLAGS_FOR_LAB_MODELS), (
            "--from predicts its run at another --world-size, --micro-batch, --stage or, on CPU ranks, "
            "--threads-per-rank (its model, precision and hardware are the run's; --gpu names a GPU run's kind)")
    else:
        # each reason said only where one of its flags was given
        unread, reasons = given(FLAGS_FOR_RUNS), []
        if unread:
            reasons.append("--world-size, --threads-per-rank and --links are --from's")
        if args.transformer is not None:
            if given(FLAGS_FOR_LAB_MODELS):
                unread += given(FLAGS_FOR_LAB_MODELS)
                reasons.append("--hidden, --depth, --input-size, --data and --loss are a lab --model's (a "
                               "--transformer has its shape)")
        elif args.target_loss is not None:
            unread.append("--target-loss")
            reasons.append("--target-loss is a --transformer's (Kaplan et al.'s law is for language models on GPT-2's "
                           "tokens; a lab model's critical batch is measured: --results from an answer, or give "
                           "--b-crit)")
        why = "; ".join(reasons)
    if unread:
        raise _bad("predict", f"{', '.join(unread)} not read here: {why}")


def _or(value: Any, default: Any) -> Any:
    """A flag's value, or its default where it was not given (None; "" and 0 are values, checked where used)."""
    return default if value is None else value


def _cluster(args: Any) -> Cluster:
    try:
        return Cluster(gpu=find_gpu(_or(args.gpu, DEFAULT_GPU)), gpus_per_node=_or(args.gpus_per_node, 1),
                       nodes=_or(args.nodes, 1), intra=_or(args.intra, "auto"),
                       inter_gbps=_or(args.inter_gbps, 0.0), host_cpu=_or(args.host_cpu, "auto"))
    except ValueError as exc:
        raise _bad("hardware", str(exc)) from None


def _strategy(args: Any) -> str:
    if args.host_memory_gb_per_s is not None and not args.offload_optimizer:
        raise _bad("host_memory_gb_per_s", "--host-memory-gb-per-s is the host's, for ZeRO-Offload's optimizer: it "
                                           "needs --stage 1-3 --offload-optimizer")
    if args.host_memory_gb_per_s is not None and not 0 < args.host_memory_gb_per_s < float("inf"):
        # predict() checks it too; here it is refused before torch loads
        raise _bad("host_memory_gb_per_s", "--host-memory-gb-per-s must be a finite bandwidth > 0, got "
                                           f"{args.host_memory_gb_per_s}")
    if args.plain_pytorch:
        if args.stage is not None or args.offload_optimizer:
            raise _bad("plain_pytorch", "--plain-pytorch takes no --stage or --offload-optimizer")
        stage, strategy = None, "torch"
    else:
        stage = 0 if args.stage is None else args.stage
        if args.offload_optimizer and stage == 0:
            raise _bad("offload_optimizer", "DeepSpeed offloads the optimizer only with ZeRO stage >= 1 (--stage 1-3)")
        strategy = f"z{stage}" + ("-offload" if args.offload_optimizer else "")
    from labkit.study.optimizer_bytes import basic_optimizer  # torch-free

    try:
        basic_optimizer(stage, args.offload_optimizer, args.optimizer)
    except ValueError as exc:
        raise _bad("optimizer", str(exc)) from None
    return strategy


def _zero(args: Any, strategy: str) -> dict[str, Any]:
    """--zero's `zero_optimization` settings, read and checked by DeepSpeed's config model at the strategy's stage."""
    if not args.zero:
        return {}
    from labkit.study import comms
    from labkit.study.predict import STRATEGIES

    if strategy == "torch":
        raise _bad("zero", "--zero sets DeepSpeed's zero_optimization; plain PyTorch has none")
    stage, offload = STRATEGIES[strategy]
    try:
        settings = comms.zero_settings(args.zero)
        comms.check_zero_settings(int(stage or 0), settings, offload)
    except ValueError as exc:
        raise _bad("zero", str(exc)) from None
    only3 = comms.stage3_only(settings) if stage != 3 else []
    if only3:
        raise _bad("zero", f"{', '.join(only3)}: ZeRO-3's only, {'it changes' if len(only3) == 1 else 'they change'} "
                           f"nothing at stage {stage}")
    return settings


def _shape(args: Any) -> Transformer | None:
    """--transformer's shape, read without torch (None: a lab --model)."""
    if args.transformer is None:
        return None
    from labkit.study.shapes import Transformer

    try:
        return Transformer.parse(args.transformer)
    except ValueError as exc:
        raise _bad("transformer", str(exc)) from None


def _lab_model(args: Any) -> RunConfig:
    """--model's RunConfig (the lab's MLP or GPT, or yours), its fields checked without torch."""
    from labkit.core.config import RunConfig

    if args.model == "gpt" and (args.data is not None or args.loss is not None):
        raise _bad("predict", "--data and --loss not read here: --model gpt is counted as its transformer shape "
                              "(its data and loss are the lab's)")
    values: dict[str, Any] = {"example": "deepspeed", "model": args.model}
    for name in FLAGS_FOR_LAB_MODELS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return RunConfig.from_dict(values)


def _refuse_uncountable(exc: BaseException, given: str | None, field_name: str = "micro_batch") -> None:
    """Refuse, naming what the user gave (`given`: the flags as typed, such as "--micro-batch 10**20" or
    "--transformer ... with --micro-batch 1"), an input too large to count: PyTorch's 64-bit sizes overflow on the
    meta device, or the memory runs out building the trace (labkit.study.predict.too_large_to_count). Others pass;
    so does everything when `given` is None (nothing the user gave is to blame)."""
    if given is None:
        return
    from labkit.study.predict import too_large_to_count

    reason = too_large_to_count(exc, given)
    if reason is not None:
        raise _bad(field_name, reason) from None


def _given_micro(micro_batch: int | None) -> str | None:
    return None if micro_batch is None else f"--micro-batch {micro_batch}"


def _workload(model: Transformer | RunConfig) -> Workload:
    from labkit.models import builders
    from labkit.study.predict import TransformerWorkload, lab_workload
    from labkit.study.shapes import Transformer

    if isinstance(model, Transformer):
        return TransformerWorkload(model)
    builders.check_importable(model)  # a model of yours: imported in a child process first (from this directory)
    import os
    import sys

    # ... and then here: the `labkit` script, unlike `python -m labkit`, does not put this directory on sys.path
    # (`labkit run`'s ranks put it first, launch.warm_launch), so a module beside the asker would not import
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return lab_workload(model)


def _accumulation(args: Any, micro: int, world_size: int) -> int:
    if args.global_batch is not None:
        if args.grad_accum is not None:
            raise _bad("global_batch", "give --global-batch or --grad-accum, not both")
        accum, rest = divmod(args.global_batch, micro * world_size)
        if accum < 1 or rest:
            raise _bad("global_batch", f"--global-batch {args.global_batch} must be micro-batch {micro} x "
                                       f"accumulation x {world_size} GPUs")
        return accum
    return args.grad_accum or 1


def _b_crit(args: Any, shape: Transformer | None) -> tuple[float, str] | None:
    """(the critical batch for the time to the same loss, where it came from), from the one of --b-crit, --results
    or --target-loss given; None: none given."""
    chosen = [f"--{name.replace('_', '-')}" for name in ("b_crit", "results", "target_loss")
              if getattr(args, name, None) is not None]
    if len(chosen) > 1:
        raise _bad("b_crit", f"{' and '.join(chosen)}: give one critical batch, not {len(chosen)}")
    if args.target_loss is not None:
        from labkit.study.noise_scale import (  # no torch: before it loads
            LM_LOSS_RANGE_NATS,
            language_model_b_crit,
            language_model_b_crit_source,
        )

        low, high = LM_LOSS_RANGE_NATS
        if not low <= args.target_loss <= high:
            raise _bad("target_loss", f"--target-loss must be a language model's loss, {low}-{high} nats per token, "
                                      f"got {args.target_loss}")
        assert shape is not None  # _refuse_unread: --target-loss goes with --transformer
        return (language_model_b_crit(args.target_loss, shape.seq),
                language_model_b_crit_source(args.target_loss, shape.seq))
    if args.b_crit is not None:
        if not 0 < args.b_crit < math.inf:
            raise _bad("b_crit", f"--b-crit must be a finite batch size > 0, got {args.b_crit}")
        return float(args.b_crit), "given (--b-crit)"
    if args.results:
        if not Path(args.results).is_dir():
            raise _bad("results", f"no such results directory: {args.results}")
        from labkit.study.predict import measured_b_crit

        try:
            measured = measured_b_crit(args.results)
        except ValueError as exc:  # a noise.csv that does not read or lacks the probes' columns: named
            raise _bad("results", str(exc)) from None
        if measured is None:
            raise _bad("results", f"{args.results} places no critical batch: no LR study in a results.csv whose "
                                  "batches place B_crit, and no noise.csv (the answer's gradient-noise probes) with a "
                                  "positive noise estimate (too few or too noisy probes); give --b-crit instead")
        return measured
    return None


def cli(args: Any) -> int:
    """`labkit predict` (labkit.cli builds the parser). Every check runs before any counting or benchmark."""
    import contextlib
    import json
    import sys

    # Libraries imported on the way (DeepSpeed's accelerator warning) write to stdout; the result is what a script
    # reads there (--format json), so anything else goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        out = _prediction(args)
    if args.format == "json":
        print(json.dumps(out, indent=2, default=float))
    else:
        print(format_table(out))
    return 0


def _prediction(args: Any) -> dict[str, Any]:
    """What `labkit predict` prints: a prediction from the flags, or calibrated on a run (`--from`)."""
    for name in ("gpus_per_node", "nodes", "micro_batch", "global_batch", "grad_accum", "world_size",
                 "threads_per_rank"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise _bad(name, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _refuse_unread(args)
    if args.from_run is not None:
        out = _cli_from_run(args)
    else:
        # What reads without torch first (the flags, the shape, a lab model's fields), then what needs it: the
        # critical batch from a results folder, and --zero, which DeepSpeed's own config model checks.
        cluster, strategy = _cluster(args), _strategy(args)
        precision = args.precision or "fp16"
        try:
            cluster.gpu.peak(precision)
        except ValueError as exc:
            raise _bad("precision", str(exc)) from None
        micro = args.micro_batch or 1
        accum = _accumulation(args, micro, cluster.world_size)
        if args.model is not None and args.activation_checkpointing:
            raise _bad("activation_checkpointing", "--activation-checkpointing is modelled for --transformer shapes "
                                                   "(the lab's models do not checkpoint)")
        shape = _shape(args)
        model = shape or _lab_model(args)
        critical = _b_crit(args, shape)
        b_crit = critical[0] if critical else None
        zero = _zero(args, strategy)
        from labkit.study.predict import predict, predicted_card, steps_to_target  # torch, DeepSpeed: after the flags

        # What the user gave, for an input too large to count: the shape as typed, and the micro-batch
        given_micro = _given_micro(args.micro_batch) or f"micro-batch {micro} (the default)"
        given = f"--transformer {args.transformer} with {given_micro}" if shape else given_micro
        try:
            workload = _workload(model)  # its own ConfigErrors name their flag
            try:
                pred = predict(workload, cluster, strategy=strategy, micro_batch=micro, grad_accum=accum,
                               precision=precision, activation_checkpointing=args.activation_checkpointing,
                               host_memory_gb_per_s=args.host_memory_gb_per_s, zero=zero,
                               optimizer=args.optimizer)
            except ValueError as exc:
                raise _bad("predict", str(exc)) from None
        except Exception as exc:  # a model of yours this process cannot import, build or run
            _refuse_uncountable(exc, given, "transformer" if shape else "micro_batch")  # PyTorch's sizes, memory
            if args.model is None or args.model in ("mlp", "gpt") or isinstance(exc, SystemExit):
                raise
            raise _bad("model", f"counting {args.model} on the meta device failed ({type(exc).__name__}: {exc}); "
                                "check that this process can import it (run from its directory or set "
                                "PYTHONPATH) and its --data and --loss (default: cross-entropy on integer "
                                "labels)") from None
        out = pred.to_dict()
        out["model"], out["n_params"], out["precision"] = workload.name, workload.n_params, precision
        if not pred.fits:  # what would: every strategy's largest micro-batch here (its censuses are cached)
            out["max_micro_batch_by_strategy"] = _largest_by_strategy(
                pred, workload, cluster, micro, accum, precision, args, zero,
                checkpointed=args.activation_checkpointing)
            if shape is not None and not args.activation_checkpointing:  # the other way to fit: recompute activations
                out["max_micro_batch_by_strategy_with_activation_checkpointing"] = _largest_by_strategy(
                    pred, workload, cluster, micro, accum, precision, args, zero, checkpointed=True)
        if critical is not None:
            out["b_crit"], out["b_crit_source"] = critical
            out["steps_to_target_over_s_min"] = steps_to_target(pred.global_batch, critical[0])
        if args.card:
            out["card"] = predicted_card(workload, cluster, strategy=strategy, micro_batch=micro, precision=precision,
                                         activation_checkpointing=args.activation_checkpointing, b_crit=b_crit,
                                         host_memory_gb_per_s=args.host_memory_gb_per_s, zero=zero,
                                         optimizer=args.optimizer)
    return out


def _largest_by_strategy(asked: Any, workload: Any, cluster: Any, micro: int, accum: int, precision: str,
                         args: Any, zero: dict[str, Any], *, checkpointed: bool) -> dict[str, int]:
    """Each strategy's largest micro-batch on the same cluster, activations checkpointed or not, for a prediction
    that does not fit: the asked one with its own settings (--zero, --optimizer), the others at DeepSpeed's defaults
    and their own default optimizer (`optimizer_for`)."""
    from labkit.study.predict import STRATEGIES, predict

    largest = {}
    for name, (_, offloaded) in STRATEGIES.items():
        own = name == asked.strategy
        if own and checkpointed == bool(args.activation_checkpointing):
            largest[name] = asked.max_micro_batch  # the prediction already made
            continue
        largest[name] = predict(
            workload, cluster, strategy=name, micro_batch=micro, grad_accum=accum, precision=precision,
            activation_checkpointing=checkpointed,
            host_memory_gb_per_s=args.host_memory_gb_per_s if offloaded else None,
            zero=zero if own else None, optimizer=args.optimizer if own else None).max_micro_batch
    return largest


def _cli_from_run(args: Any) -> dict[str, Any]:

    from labkit.study.calibrate import calibrated, link_fits, read_run

    if not args.from_run or not Path(args.from_run).is_dir():
        raise _bad("from_run", f"no such run directory: {args.from_run}")
    if not (Path(args.from_run) / "config.json").exists():
        raise _bad("from_run", f"not a labkit run directory (no config.json): {args.from_run}")
    # finished first: a run that failed (out of memory, say) is told so, not that it has no step records
    accelerator = _check_calibratable(Path(args.from_run))
    try:
        run = read_run(args.from_run, "mean")
    except ValueError as exc:
        raise _bad("from_run", str(exc)) from None
    _check_run_config(run)
    stage = args.stage
    if stage == 0 and run.offload:
        raise _bad("stage", "the run offloads its optimizer: stage 0 cannot")
    if accelerator != "cpu":
        return _from_gpu_run(args, read_run(args.from_run, "median"))  # the answer's statistic for GPU steps
    if args.gpu is not None:
        raise _bad("gpu", "--gpu names a GPU run's kind; this run's ranks ran on this machine's CPU")
    _check_run_config(run, args)
    if args.links:
        text = _links_json(args.links)
        # a fit has its "fits" per op, or the timed calls it is fitted from ("raw"): any other JSON (a model's
        # config.json, say) is not one, rather than a fit summarised by the wrong statistic
        if not isinstance(text, dict) or not (isinstance(text.get("fits"), dict) or text.get("raw")):
            raise _bad("links", f"{args.links} is not a link fit (`labkit.study.predict.link_fit_json`: its \"fits\" "
                                "per op, or the timed calls they are fitted from, \"raw\")")
        try:
            fit = link_fits(text, "mean")  # the run's steps: their mean
        except (ValueError, KeyError, TypeError) as exc:
            raise _bad("links", f"{args.links} is not a link fit ({type(exc).__name__}: {exc})") from None
    else:
        from labkit.study import comms

        # the link as training meets it at several settings of the compute before each call, read at the run's own
        # compute per collective, every call summarised as the run's steps are (their mean)
        fit = link_fits(comms.measure_training_links(world_size=max(2, args.world_size or run.world_size)), "mean")
    try:
        return calibrated(run, fit, world_size=args.world_size, micro_batch=args.micro_batch, stage=stage,
                          threads_per_rank=args.threads_per_rank)
    except (RuntimeError, TypeError) as exc:
        _refuse_uncountable(exc, _given_micro(args.micro_batch))
        raise


# The flags --from changes a CPU run's config with, as `calibrated` sets them
FLAGS_INTO_THE_RUN = ("world_size", "micro_batch", "stage", "threads_per_rank")


def _check_run_config(run: Any, args: Any = None) -> None:
    """The run's config.json read as labkit reads a config (a value of the wrong type is the run's, not a flag's);
    with `args`, then at the flags' --world-size, --micro-batch, --stage and --threads-per-rank, each named where
    the config refuses them (--world-size 100000 leaves each rank no sample of the run's dataset: the flag's)."""
    from labkit.core.config import RunConfig, without_local_device_checks

    own = {k: v for k, v in run.config.items() if k in RunConfig.__dataclass_fields__}
    given = {name: getattr(args, name) for name in FLAGS_INTO_THE_RUN if getattr(args, name, None) is not None}
    with without_local_device_checks():  # the run's machine, not necessarily this one
        try:
            RunConfig.from_dict(own)
        except (ValueError, TypeError) as exc:  # ConfigError, or a check meeting a value of the wrong type
            raise _bad("from_run", f"{Path(run.run_dir) / 'config.json'}: {exc}") from None
        if not given:
            return
        try:
            RunConfig.from_dict({**own, **given})
        except (ValueError, TypeError) as exc:
            field = getattr(exc, "field", None)
            named = [field] if field in given else list(given)  # the flag the refusal names, else all given
            flags = " ".join(f"--{name.replace('_', '-')} {given[name]}" for name in named)
            why = str(exc).removeprefix(f"{field}: ") if field else str(exc)
            raise _bad(named[0], f"{flags} does not fit the run's config: {why}") from None


def _links_json(path: str) -> Any:
    """--links's file, read as JSON (a link fit as `labkit.study.predict.link_fit_json` writes it), else exit 2."""
    import json

    if not Path(path).is_file():
        raise _bad("links", f"no such link fit: {path}")
    try:
        return json.loads(Path(path).read_text())
    except ValueError as exc:
        raise _bad("links", f"{path} is not JSON ({exc}): give a link fit as `labkit.study.predict.link_fit_json` "
                            "writes it (data/predict-ci/links.json)") from None


def _check_calibratable(run_dir: Path) -> str:
    """--from calibrates a finished run (its summary says finished); returns where its ranks ran: `cpu` (the
    calibration of CPU ranks on this machine) or `cuda` (the GPU model, calibrated)."""
    import json

    from labkit.study.calibrate import ready_record

    summary = run_dir / "summary.json"
    try:
        status = json.loads(summary.read_text()).get("status") if summary.is_file() else None
    except (ValueError, AttributeError) as exc:
        raise _bad("from_run", f"{summary} does not read ({exc}): calibrate on a finished run") from None
    if status != "finished":
        raise _bad("from_run", f"{run_dir} did not finish (its summary.json says {status!r}; none: still running or "
                               "killed): calibrate on a finished run")
    accelerator = str(ready_record(run_dir).get("accelerator") or "cpu")
    if accelerator not in ("cpu", "cuda"):
        raise _bad("from_run", f"{run_dir} ran on {accelerator}: --from calibrates runs on CPU ranks or CUDA GPUs")
    return accelerator


def _from_gpu_run(args: Any, run: Any) -> dict[str, Any]:
    """--from a run on GPUs: the GPU model at the new world size (one node of the run's GPU kind), micro-batch or
    stage, calibrated on what the run measured (`calibrate.calibrated_gpu`); the links the GPU kind's presets, or a
    fit measured on the GPUs (--links, NCCL: `labkit.study.predict.measure_links`)."""

    from labkit.study.calibrate import calibrated_gpu
    from labkit.study.predict import FittedLinks

    if args.threads_per_rank is not None:
        raise _bad("threads_per_rank", "--threads-per-rank is a CPU rank's; this run's ranks ran on GPUs")
    if args.gpu is not None:  # the flag's own error, not the run's (from_run)
        from labkit.runtime.hardware import gpu as find_gpu

        try:
            find_gpu(args.gpu)
        except ValueError as exc:
            raise _bad("gpu", str(exc)) from None
    links = None
    if args.links:
        fit = _links_json(args.links)
        if not isinstance(fit, dict) or not isinstance(fit.get("fits"), dict) or "all_reduce" not in fit["fits"]:
            raise _bad("links", f"{args.links} is not a link fit (`labkit.study.predict.link_fit_json`: its \"fits\" "
                                "per op, all_reduce's at least)")
        if fit.get("backend") != "nccl":  # a gloo fit on CPU ranks would time GPUs' collectives as the CPU's
            raise _bad("links", f"{args.links} was measured with {fit.get('backend')!r}, not NCCL: a run on GPUs takes "
                                "a link fit measured on GPUs (`labkit.study.predict.measure_links` there), or none "
                                "(the GPU kind's preset links)")
        links = FittedLinks(fit)
    try:
        return calibrated_gpu(run, gpu=args.gpu, world_size=args.world_size, micro_batch=args.micro_batch,
                              stage=args.stage, links=links)
    except (ValueError, KeyError, TypeError) as exc:  # a config.json that lacks a field or is not an object too
        _refuse_uncountable(exc, _given_micro(args.micro_batch))  # not the config's: past PyTorch's sizes
        why = str(exc) if isinstance(exc, ValueError) else f"{run.run_dir}'s config: {type(exc).__name__}: {exc}"
        raise _bad("from_run", why) from None


def _fitting(largest: dict[str, int]) -> str:
    """"z2-offload 1, z3-offload 3 (the others none)": the strategies that fit, with their largest micro-batch."""
    fitting = [f"{name} {m}" for name, m in largest.items() if m > 0]
    rest = " (the others none)" if len(fitting) < len(largest) else ""
    return ", ".join(fitting) + rest if fitting else "none fits"


def format_table(out: dict[str, Any]) -> str:
    """The JSON as lines a person reads, every number labelled predicted."""
    lines = [f"PREDICTED ({out.get('hardware') or 'calibrated on ' + str(out.get('calibrated_from'))})"]
    for key in ("strategy", "optimizer", "stage", "world_size", "micro_batch", "grad_accum", "global_batch",
                "step_time_s", "step_time_s_if_the_miss_grows", "step_time_s_if_nothing_hides", "samples_per_s",
                "model_tflops_per_gpu", "hardware_tflops_per_gpu", "compute_s", "comm_s", "exposed_comm_s",
                "offload_s", "offload_transfer_s", "offload_host_s", "device_bytes", "step_peak_bytes",
                "usable_memory_bytes", "fits",
                "max_micro_batch",
                "measured_step_time_s", "steps_to_target_over_s_min"):
        if out.get(key) is not None and not (key in ("offload_transfer_s", "offload_host_s")
                                             and not out.get("offload_s")) \
                and not (key == "step_time_s_if_nothing_hides" and out[key] == out["step_time_s"]
                         and not out.get("caveats")):  # a caveat names it: printed
            value = out[key]
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            label = "measured " if key.startswith("measured_") else "predicted"  # the run it was calibrated on
            if key == "steps_to_target_over_s_min":  # the critical batch is an input: said beside it
                text += f" (B_crit {out['b_crit']:.4g} samples: {out.get('b_crit_source') or 'given'})"
            lines.append(f"  {label} {key:29s} {text}")
    if out.get("run_slower_than_model"):  # one run cannot split what the model misses: both readings are printed
        lines.append("  predicted two ways: the run was slower than the model; step_time_s reads the difference as "
                     "fixed work (launches, Python), step_time_s_if_the_miss_grows as a device slower than its "
                     "roofline")
    largest = out.get("max_micro_batch_by_strategy")
    if largest:
        lines.append(f"  predicted not to fit at micro-batch {out['micro_batch']}; the largest micro-batch per "
                     f"strategy on this cluster: " + _fitting(largest))
    checkpointed = out.get("max_micro_batch_by_strategy_with_activation_checkpointing")
    if checkpointed:
        lines.append("  predicted with --activation-checkpointing (a recomputed forward per micro-step): "
                     + _fitting(checkpointed))
    if out.get("zero"):
        lines.append("  with zero_optimization " + ", ".join(f"{k}={v}" for k, v in out["zero"].items()))
    if out.get("strategy") == "torch":  # what plain PyTorch is predicted as
        how = "in fp32" if out.get("precision") == "fp32" else "under autocast (fp32 parameters and gradients)"
        lines.append(f"  plain PyTorch: torch DDP {how}, its gradient buckets beside the gradients"
                     if out.get("world_size", 1) > 1 else f"  plain PyTorch: torch {how}, one GPU")
    card = out.get("card")
    if card:
        lines.append("  predicted answer card (time at the larger global batch / at the smaller):")
        for way, kinds in card["ways"].items():
            cells = [f"{kind} {e['verdict'] or '-'}" + (f" ({e['ratio']:.2f}x)" if e["ratio"] else "")
                     for kind, e in kinds.items()]
            if not any(e["verdict"] for e in kinds.values()):  # no verdict: say why (the same for the three)
                cells = [next(iter(kinds.values()))["condition"].removeprefix("predicted: ")]
            first = next(iter(kinds.values()))
            batches = f"batch {first['from_batch']} -> {first['to_batch']}: " if first["from_batch"] else ""
            lines.append(f"    predicted {way:12s} " + batches + ", ".join(cells))
        lines.append(f"  {card['deepspeed']}")  # "predicted against ZeRO stage 0 ...", under the ways' rows
    lines += [f"  {text}" for text in out.get("caveats", [])]  # each says "predicted ..." first
    return "\n".join(lines)
