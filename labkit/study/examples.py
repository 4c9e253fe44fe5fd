"""The source text's three examples beside their corrected scripts in `notebooks/examples/`.

    from labkit.study import examples
    examples.source_code(2)                        # the text's Example 2, verbatim
    examples.script_code("ex2_zero_offload.py")    # the corrected script
    diff = examples.side_by_side(2)                # shows as a table: the text | corrected | why
    diff.unexplained                               # changes no reason matched (notebooks check it is empty)
    examples.script_config("ex3_zero3.py", world_size=2, steps=20)   # the RunConfig of `labkit run --script`
    examples.script_twin(config)                   # labkit's run of the same model (what labkit predicts from)

A reason is a (needle, why) pair: it explains every change whose lines (the text's or the script's)
contain the needle; the first pair that matches wins. A change no pair matches is listed in
`unexplained`, so a script edited without saying why fails its notebook's check.
"""

from __future__ import annotations

import argparse
import difflib
import html
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from labkit.core.config import RunConfig

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "examples"
SOURCE_TEXT = "source_text.md"  # the text's three examples, verbatim
SCRIPTS = {1: "ex1_pytorch.py", 2: "ex2_zero_offload.py", 3: "ex3_zero3.py"}
# The DeepSpeed config each script reads when no --deepspeed_config is given (Example 1 has none), and the values
# the scripts' own arguments default to (tests/study/test_examples.py reads them from the scripts).
SCRIPT_DS_CONFIGS = {"ex2_zero_offload.py": "ex2_ds_config.json", "ex3_zero3.py": "ex3_ds_config.json"}
SCRIPT_DEFAULTS = {"hidden": 500, "depth": 1, "num-samples": 1000, "batch-size": 64}
SAME_SHOWN = 3  # a run of unchanged lines longer than this shows its first and last line only
_CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_INLINE_CODE = re.compile(r"`([^`]+)`")
# What the scripts print at each epoch's end (rank 0).
_EPOCH_LINE = re.compile(r"^Epoch (?P<epoch>\d+), step (?P<step>\d+): training loss (?P<train>[\d.]+), "
                         r"held-out loss (?P<held_out>[\d.]+)$", re.MULTILINE)


# Why each line of the text changed: (needle, why) pairs, per example first, then those shared by all three.
_DOCSTRING = ('"""Example', "A docstring: what the script is and how to run it, plainly, with DeepSpeed's "
                             "launcher, or under `labkit run --script` (supervised, with live charts).")
_SHARED_REASONS = [
    ("import labkit", "`labkit`, for its one line per step (a no-op outside labkit)."),
    ("import ", "Imports: the text's unused ones go (`torch.optim as optim` in Examples 2-3, `os` in 3); argparse for "
                "the command line, the shared model and data (`simple_model.py`), `DistributedSampler`, "
                "`deepspeed.comm` for the rank, and `labkit` for its one line per step (a no-op outside labkit)."),
    ("class SimpleModel", "The model moved to `simple_model.py`, shared by the three scripts (the text repeats it in "
                          "each example): the same Linear-ReLU-Linear, with a `depth` parameter (1 is the text's)."),
    ("x = self.fc1(x)", "The model's forward, in `simple_model.py` too."),
    ("input_size = 100", "The sizes are command-line arguments now (the text's values are their defaults)."),
    ("torch.randint", "The text's labels are random: a model can memorise them (its training loss falls), but they "
                      "hold nothing a held-out set can measure. `teacher_data` labels the inputs with a fixed random "
                      "linear teacher and keeps 1,000 held-out samples; `--random-labels` brings the text's labels "
                      "back, to compare."),
    ("parser = argparse", "Arguments as a practitioner writes them: `--steps` (optimizer steps, not the text's fixed "
                          "5 epochs), the sizes with the text's values as defaults, and `--local_rank`, which "
                          "DeepSpeed's launcher passes to every rank."),
    ("TensorDataset(data, labels)", "The dataset is built by `teacher_data` (a training and a held-out set)."),
    ("model = SimpleModel(input_size", "The model's sizes come from the arguments."),
    ("step = epoch = 0", "The loop runs `--steps` optimizer steps, epoch after epoch."),
    ("# Training loop", "The loop runs `--steps` optimizer steps, epoch after epoch, instead of exactly 5 epochs: "
                        "runs of different batch sizes and rank counts are compared by steps and samples."),
    ('print(f"Epoch {epoch+1}', "The text prints the last batch's training loss; the held-out loss says whether the "
                                "model learned anything that holds beyond its training samples."),
]
_DEEPSPEED_REASONS = [
    ("get_accelerator().set_device", "Each rank on its own device first (NCCL binds to the current GPU; every "
                                     "launcher sets `LOCAL_RANK`; a no-op on CPU ranks), through DeepSpeed's "
                                     "accelerator, never a hard-coded `cuda`; then the process group (NCCL on GPUs, "
                                     "gloo on CPU ranks): the sampler needs this rank and the number of ranks. Data "
                                     "and weights are seeded, the same on every rank."),
    ("deepspeed.init_distributed", "The process group first (the accelerator's backend: NCCL on GPUs, gloo on CPU "
                                   "ranks): the sampler needs this rank and the number of ranks. Data and weights "
                                   "are seeded, the same on every rank."),
    ("sampler.set_epoch", "`set_epoch`: a DistributedSampler shuffles with its seed plus the epoch, so without it "
                          "every epoch reads the same order."),
    ("DistributedSampler(train", "A `DistributedSampler`: each rank reads its own 1/N of the data. With the text's "
                                 "shuffled DataLoader every rank reads the whole dataset, so N ranks process N copies "
                                 "of each epoch. The batch size is the config's micro-batch; `drop_last` keeps every "
                                 "rank's batches full and their step counts equal. Rank 0 prints the batch DeepSpeed "
                                 "settled on and the Adam it chose."),
    ("DataLoader(dataset", "Without a sampler every rank reads the whole dataset (the sampler comes below)."),
    ("config_params", "The config comes from the JSON file named by `--deepspeed_config` (through `args=args`); "
                      "`config_params` is the old name of `config=`."),
    ("deepspeed.initialize(args=args", "`deepspeed.initialize` reads the config that `args.deepspeed_config` names."),
    ("get_data_types()", "The precision is the config's: inputs are cast to the engine's dtype (bf16 or fp16 when "
                         "the config enables one, fp32 as committed). A bf16 engine fed fp32 inputs fails in its "
                         "first Linear."),
    ("batch_data.to(model_engine.device, dtype)", "Inputs in the engine's dtype (see `dtype` above)."),
    ("outputs.float()", "The loss in fp32: a cross-entropy in bf16 loses precision (a no-op in fp32)."),
    ("gradient_accumulation_steps micro-batches", "Only a comment: with gradient accumulation, `step()` updates the "
                                                  "weights at the accumulation boundary only."),
    ("model_engine.global_steps", "`global_steps` counts optimizer steps (one per `gradient_accumulation_steps` "
                                  "micro-batches): one `labkit.record` per optimizer step, `--steps` of them. At "
                                  "each epoch's end every rank computes the held-out loss (under ZeRO-3 the forward "
                                  "gathers parameters, so all ranks must run it) and rank 0 prints it. The process "
                                  "group is destroyed before exit."),
]
REASONS: dict[int, list[tuple[str, str]]] = {
    1: [_DOCSTRING,
        ("model = SimpleModel(input_size", "The model goes to the device (the text leaves it on the CPU); its "
                                           "sizes come from the arguments."),
        ("torch.accelerator", "The text never moves the model or the data to a GPU: its loop runs on the CPU "
                              "whatever the batch, so it cannot run out of GPU memory as its commentary says. "
                              "`torch.accelerator` picks the GPU when there is one (never a hard-coded cuda). "
                              "Data and initial weights are seeded."),
        ("DataLoader(dataset", "`drop_last`: every step a full batch (the text's last batch of each epoch has 40 "
                               "samples: 1000 = 15 x 64 + 40)."),
        ("# Model, Loss, Optimizer", "Only a comment."),
        ("optimizer = optim.Adam", "`torch.optim.Adam`, the learning rate from the arguments."),
        ("batch_data.to(device)", "The batch goes to the model's device."),
        ("labkit.record", "One `labkit.record` per step feeds labkit's live charts and summary (a no-op outside "
                          "labkit); the loop stops after `--steps` steps."),
        ("held_out_loss(model", "The held-out loss at each epoch's end."),
        *_SHARED_REASONS],
    2: [_DOCSTRING,
        ("# DeepSpeed Configuration", "The config moved to `ex2_ds_config.json`, corrected. Stage 2 with "
                                      "`offload_optimizer`: stage 1 is optimizer-state partitioning, not ZeRO-Offload; "
                                      "offload is the `offload_optimizer` block, valid with stages 1-3, and the "
                                      "ZeRO-Offload paper built it on stage 2. `train_micro_batch_size_per_gpu` and "
                                      "`gradient_accumulation_steps` instead of `train_batch_size`: DeepSpeed derives "
                                      "the global batch (64 x 1 x ranks), where the text's 64 holds on one rank only. "
                                      "`weight_decay` 0 written out: DeepSpeed's \"Adam\" runs in AdamW mode and, "
                                      "without FusedAdam or CPU Adam (`torch_adam`), is torch's AdamW with its "
                                      "default decay 0.01 (runtime/engine.py:2382). "
                                      "bf16 named, disabled (fp32) as the text's fp16 was."),
        ("# Model, Loss, Optimizer", "Only a comment."),
        *_DEEPSPEED_REASONS, *_SHARED_REASONS],
    3: [_DOCSTRING,
        ("# DeepSpeed Configuration", "The config moved to `ex3_ds_config.json`, corrected. No `train_batch_size`: "
                                      "the text sets it to the micro-batch, 64, so on 2 ranks DeepSpeed derives "
                                      "`gradient_accumulation_steps` = 64 / (64 x 2) = 0 and stops. The micro-batch "
                                      "per rank and the accumulation are set and DeepSpeed derives the global batch "
                                      "(64 x 1 x ranks). `weight_decay` 0 written out, as in Example 2."),
        ("deepspeed.zero.Init", "`zero.Init` partitions each parameter as the model is built: a model too big for "
                                "one device can be constructed at all (the text builds it whole on every rank "
                                "first)."),
        ("# Initialize DeepSpeed", "Only a comment."),
        ("import os", "Imports: the text's unused `os` and `torch.optim as optim` go; argparse, pathlib, the shared "
                      "model and data, `DistributedSampler`, `deepspeed.comm` and `labkit` come in."),
        *_DEEPSPEED_REASONS, *_SHARED_REASONS],
}


def example_path(name: str) -> Path:
    """A file of `notebooks/examples/` (a script, a DeepSpeed config, the source text)."""
    path = EXAMPLES_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: labkit must be installed from its checkout "
                                "(pip install -e .), where notebooks/examples/ lives")
    return path


def source_code(number: int) -> str:
    """The source text's Example `number` (1-3), verbatim."""
    blocks = _CODE_BLOCK.findall(example_path(SOURCE_TEXT).read_text())
    if not 1 <= number <= len(blocks):
        raise ValueError(f"the source text has Examples 1-{len(blocks)}, not {number}")
    return blocks[number - 1]


def script_code(name: str) -> str:
    return example_path(name).read_text()


@dataclass(kw_only=True)
class Block:
    """A run of lines: unchanged (`reason` unused), or one change with its reason (None: unexplained)."""

    text: list[tuple[int, str]]    # (line number in the text's example, line)
    script: list[tuple[int, str]]  # (line number in the script, line)
    changed: bool
    reason: str | None = None


@dataclass(kw_only=True)
class SideBySide:
    """The text's example and its corrected script aligned line by line; shows as an HTML table."""

    title_text: str
    title_script: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def changes(self) -> list[Block]:
        return [b for b in self.blocks if b.changed]

    @property
    def unexplained(self) -> list[str]:
        """Each change no reason matched, as its lines ('-' the text's, '+' the script's)."""
        return ["\n".join([*(f"- {line}" for _, line in b.text), *(f"+ {line}" for _, line in b.script)])
                for b in self.changes if b.reason is None]

    def _repr_html_(self) -> str:
        cell = "vertical-align:top;text-align:left;padding:2px 6px;border-top:1px solid #ddd"

        def pre(lines: list[tuple[int, str]], colour: str) -> str:
            body = "\n".join(f"<span style='color:#999'>{n:>3}</span> {html.escape(line)}" for n, line in lines)
            return (f"<td style='{cell};background:{colour}'><pre style='margin:0;font-size:11px;"
                    f"background:transparent;white-space:pre-wrap;word-break:break-word'>{body}</pre></td>")

        rows = []
        for block in self.blocks:
            if block.changed:
                why = _INLINE_CODE.sub(r"<code>\1</code>", html.escape(block.reason or "(no reason given)"))
                rows.append("<tr>" + pre(block.text, "#fde8e8" if block.text else "transparent")
                            + pre(block.script, "#e6f6e6" if block.script else "transparent")
                            + f"<td style='{cell};font-size:12px'>{why}</td></tr>")
            else:
                rows.append("<tr>" + pre(_elide(block.text), "transparent") + pre(_elide(block.script), "transparent")
                            + f"<td style='{cell}'></td></tr>")
        head = "".join(f"<th style='text-align:left;width:{width}'>{html.escape(title)}</th>" for title, width in
                       ((self.title_text, "36%"), (self.title_script, "40%"), ("why", "24%")))
        return (f"<table style='border-collapse:collapse;width:100%;table-layout:fixed;font-family:sans-serif'>"
                f"<tr>{head}</tr>{''.join(rows)}</table>")

    def __repr__(self) -> str:
        return f"SideBySide({self.title_text} -> {self.title_script}: {len(self.changes)} changes, " \
               f"{len(self.unexplained)} unexplained)"


def _elide(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    if len(lines) <= SAME_SHOWN:
        return lines
    return [lines[0], (lines[1][0], f"⋮ ({len(lines) - 2} more lines, the same on both sides)"), lines[-1]]


def compare(text: str, script: str, reasons: Sequence[tuple[str, str]], *, title_text: str = "the text",
            title_script: str = "corrected") -> SideBySide:
    """Align `text` and `script` line by line and give each change the first reason whose needle
    occurs in its lines. Indentation, blank lines and trailing comments do not count as changes of a
    line; inside a changed region, similar lines are paired (as `difflib.Differ` pairs them) and the
    rest shows as lines taken out or put in, one paragraph of either side per row."""
    a, b = _lines(text), _lines(script)
    result = SideBySide(title_text=title_text, title_script=title_script)
    matcher = difflib.SequenceMatcher(None, [_key(x) for x in a], [_key(y) for y in b], autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            result.blocks.append(Block(text=_shown(a[i1:i2]), script=_shown(b[j1:j2]), changed=False))
            continue
        result.blocks += [Block(text=_shown(left), script=_shown(right), changed=True)
                          for left, right in _pair(a[i1:i2], b[j1:j2])]
    result.blocks = _merge_imports(result.blocks)
    for block in result.changes:
        lines = [line for _, line in block.text + block.script]
        block.reason = next((why for needle, why in reasons if any(needle in line for line in lines)), None)
    return result


def _is_import(line: str) -> bool:
    return line.startswith(("import ", "from "))


def _merge_imports(blocks: list[Block]) -> list[Block]:
    """Consecutive blocks made only of imports, one of them changed, as one change: imports read best whole."""
    merged: list[Block] = []
    for block in blocks:
        imports = all(_is_import(line) for _, line in block.text + block.script)
        previous = merged[-1] if merged else None
        if imports and previous is not None and all(_is_import(line) for _, line in previous.text + previous.script):
            previous.text = sorted(previous.text + block.text)
            previous.script = sorted(previous.script + block.script)
            previous.changed = previous.changed or block.changed
        else:
            merged.append(Block(text=list(block.text), script=list(block.script), changed=block.changed))
    return merged


_Line = tuple[int, int, str]  # (line number, paragraph number, line) of a non-blank line
PAIR_CUTOFF = 0.6  # two lines this similar (difflib's ratio, comments left out) are one line changed


def _lines(code: str) -> list[_Line]:
    """The non-blank lines; a blank line starts a new paragraph, except inside a docstring."""
    lines, paragraph, in_docstring = [], 0, False
    for number, line in enumerate(code.splitlines(), 1):
        if not line.strip():
            paragraph += 0 if in_docstring else 1
        else:
            lines.append((number, paragraph, line.rstrip()))
            in_docstring ^= line.count('"""') % 2 == 1
    return lines


def _key(line: _Line) -> str:
    return line[2].strip()


def _code(line: _Line) -> str:
    """The line without indentation or a trailing comment (a `#` inside a string cuts it short: harmless)."""
    return line[2].split("  #")[0].strip().lower()


def _shown(lines: list[_Line]) -> list[tuple[int, str]]:
    return [(number, line) for number, _, line in lines]


def _pair(a: list[_Line], b: list[_Line]) -> list[tuple[list[_Line], list[_Line]]]:
    """A changed region as rows: the most similar pair of lines (if similar enough) as one row, the
    regions before and after it recursively, and unpaired lines grouped by paragraph."""
    if not a or not b:
        return [(group, []) for group in _paragraphs(a)] + [([], group) for group in _paragraphs(b)]
    best, at = 0.0, (0, 0)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            ratio = difflib.SequenceMatcher(None, _code(x), _code(y), autojunk=False).ratio()
            if ratio > best:
                best, at = ratio, (i, j)
    if best < PAIR_CUTOFF:
        return _pair(a, []) + _pair([], b)
    i, j = at
    return [*_pair(a[:i], b[:j]), ([a[i]], [b[j]]), *_pair(a[i + 1:], b[j + 1:])]


def _paragraphs(lines: list[_Line]) -> list[list[_Line]]:
    groups: list[list[_Line]] = []
    for line in lines:
        if groups and groups[-1][-1][1] == line[1]:
            groups[-1].append(line)
        else:
            groups.append([line])
    return groups


def side_by_side(number: int) -> SideBySide:
    """The text's Example `number` beside its corrected script, with `REASONS[number]`."""
    return compare(source_code(number), script_code(SCRIPTS[number]), REASONS[number],
                   title_text=f"the text's Example {number}", title_script=f"notebooks/examples/{SCRIPTS[number]}")


def script_config(name: str, *, world_size: int, steps: int, args: Sequence[str] = ()) -> RunConfig:
    """The RunConfig of `labkit run --script notebooks/examples/<name> --world-size N --steps S --
    <args> --steps S`: the script runs `steps` optimizer steps, and labkit's progress counts them."""
    if isinstance(args, str):  # "--hidden 5" would be passed letter by letter
        raise ValueError(f"args is a list of arguments, e.g. {args.split()!r}, got the string {args!r}")
    return RunConfig(script=str(example_path(name)), script_args=[*args, "--steps", str(steps)],
                     world_size=world_size, steps=steps)


def script_twin(config: RunConfig) -> RunConfig:
    """The labkit run (its own worker) that trains what `config`, an example script's run (`script_config`),
    trains: the same MLP (simple_model.py's is labkit's), ranks and steps, the script's sizes from its arguments,
    and the micro-batch, accumulation, ZeRO stage, offload, precision and optimizer of the DeepSpeed config the
    script loads. What labkit predicts a script run from (labkit.study.device_need.predicted_device_bytes); the
    scripts' held-out pass (1,000 samples at each epoch's end, without gradients) is not in it."""
    name = Path(config.script or "").name
    if name not in SCRIPTS.values():
        raise ValueError(f"no twin for script {config.script!r}: only the examples {sorted(SCRIPTS.values())}")
    parser = argparse.ArgumentParser(add_help=False)
    for option, default in SCRIPT_DEFAULTS.items():
        parser.add_argument(f"--{option}", type=int, default=default)
    parser.add_argument("--deepspeed_config", default=None)
    args, _ = parser.parse_known_args(config.script_args)
    model = dict(hidden=args.hidden, depth=args.depth, dataset_size=args.num_samples, world_size=config.world_size,
                 steps=config.steps)
    if name not in SCRIPT_DS_CONFIGS:  # Example 1: plain PyTorch in fp32, its batch an argument
        return RunConfig(example="pytorch", micro_batch=args.batch_size, **model)
    ds = json.loads(Path(args.deepspeed_config).read_text() if args.deepspeed_config
                    else script_code(SCRIPT_DS_CONFIGS[name]))
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload = zero.get("offload_optimizer", {}).get("device", "none") != "none"
    precision: Literal["fp32", "bf16", "fp16"] = (
        "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32")
    # torch's SGD without momentum holds no state (labkit's "sgd"); any other optimizer is taken as Adam, whose two
    # moments are the most a basic optimizer holds here
    basic = ds.get("optimizer", {})
    optimizer: Literal["adam", "sgd"] = (
        "sgd" if str(basic.get("type", "")).lower() == "sgd" and not basic.get("params", {}).get("momentum")
        else "adam")
    return RunConfig(example="offload" if offload else "zero3" if stage == 3 else "deepspeed", stage=stage,
                     offload_optimizer=offload, precision=precision, micro_batch=ds["train_micro_batch_size_per_gpu"],
                     grad_accum=ds.get("gradient_accumulation_steps", 1), optimizer=optimizer, **model)


def command_line(config: RunConfig) -> str:
    """The `labkit run --script` command that launches `config` from the repository's root."""
    script = Path(config.script or "")
    shown = script.relative_to(EXAMPLES_DIR.parents[1]) if script.is_relative_to(EXAMPLES_DIR.parents[1]) else script
    return shlex.join(["labkit", "run", "--script", str(shown), "--world-size", str(config.world_size),
                       "--steps", str(config.steps), "--", *config.script_args])


def config_variant(name: str, out_dir: str | Path, **changes: Any) -> Path:
    """A copy of the DeepSpeed config `name` with top-level keys replaced (`bf16={"enabled": True}`, ...),
    written to `out_dir`: what a GPU profile passes as `--deepspeed_config` (the committed file stays)."""
    config = json.loads(example_path(name).read_text())
    config.update(changes)
    out = Path(out_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config, indent=2) + "\n")
    return out


def epoch_losses(run: Any) -> pd.DataFrame:
    """What an example script printed at each epoch's end (rank 0's log): one row per epoch with the
    step reached, the last batch's training loss and the held-out loss."""
    from labkit.core.records import rank_logs_text

    rows = [{"epoch": int(m["epoch"]), "step": int(m["step"]), "training loss": float(m["train"]),
             "held-out loss": float(m["held_out"])} for m in _EPOCH_LINE.finditer(rank_logs_text(run.run_dir, 0))]
    return pd.DataFrame(rows, columns=["epoch", "step", "training loss", "held-out loss"]).set_index("epoch")
