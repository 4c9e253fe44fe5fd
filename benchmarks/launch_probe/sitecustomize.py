"""bench_launch.py's probe: where a Python process of a launch spends its start, stamped from the inside.

Python imports `sitecustomize` at start-up from the first directory on sys.path that has one; bench_launch.py
puts this directory on PYTHONPATH, with LABKIT_LAUNCH_PROBE_DIR, for every process of the launches it times
(labkit's supervisor, DeepSpeed's runner and launch.py, the rank guard, the ranks; the bare launcher's too).
Nothing else sets them: outside the benchmark this file is never imported. Without LABKIT_LAUNCH_PROBE_DIR it
does nothing. With it, each process appends JSON lines to `<dir>/<pid>.jsonl` (one os.write each):

- `up`: the interpreter is initialised (site done, the main module not yet run), with its first 8 arguments;
- `import`: begin and end of every outermost import of a module of torch, deepspeed or labkit (one that is
  not nested in an import of the same package; an import of torch inside deepspeed's is torch's);
- `rendezvous`: labkit's `init_distributed` and `deepspeed.init_distributed` (process group, rendezvous);
- `initialize`: `deepspeed.initialize`;
- `op_load`: DeepSpeed's `OpBuilder.load` (JIT op loads, from TORCH_EXTENSIONS_DIR's cache), by op name;
- `forward1` / `step1`: the first module forward begins / the first optimizer step ends (torch's global
  module and optimizer-step hooks, removed once they fired).

Its own cost: one finder call per import (a string test for all but the watched packages), a wrapper per
watched call, ~20 short writes per process. Why not `python -X importtime`: it prints to stderr, where
DeepSpeed's runner and launch.py share one log and cannot be told apart, and it stamps no wall clock.
"""

import os
import sys
import time

_DIR = os.environ.get("LABKIT_LAUNCH_PROBE_DIR")
PACKAGES = ("torch", "deepspeed", "labkit")


def _quoted(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _emit(event, begin, end=None, name=None, argv=None):
    fields = [f'"event":"{event}"', f'"pid":{os.getpid()}', f'"begin":{begin:.6f}']
    if end is not None:
        fields.append(f'"end":{end:.6f}')
    if name is not None:
        fields.append(f'"name":"{name}"')
    if argv is not None:
        fields.append('"argv":[' + ",".join(_quoted(arg) for arg in argv[:8]) + "]")
    rank = os.environ.get("RANK")
    if rank is not None and rank.isdigit():
        fields.append(f'"rank":{rank}')
    fd = os.open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, ("{" + ",".join(fields) + "}\n").encode())
    finally:
        os.close(fd)


def _timed(event, function, name_of=None):
    def timed(*args, **kwargs):
        begin = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            _emit(event, begin, time.time(), name_of(args) if name_of else None)

    timed.__wrapped__ = function
    timed.__name__ = getattr(function, "__name__", event)
    timed.__doc__ = getattr(function, "__doc__", None)
    return timed


def _patch_deepspeed(module):
    module.init_distributed = _timed("rendezvous", module.init_distributed)
    module.initialize = _timed("initialize", module.initialize)


def _patch_rendezvous(module):
    module.init_distributed = _timed("rendezvous", module.init_distributed)


def _patch_op_builder(module):
    module.OpBuilder.load = _timed("op_load", module.OpBuilder.load, lambda args: getattr(args[0], "name", "?"))


def _patch_torch(module):
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handles = {}

    def first_forward(*_args):
        _emit("forward1", time.time())
        handles.pop("forward").remove()

    def first_step(*_args):
        _emit("step1", time.time())
        handles.pop("step").remove()

    handles["forward"] = register_module_forward_pre_hook(first_forward)
    handles["step"] = register_optimizer_step_post_hook(first_step)


PATCHES = {"deepspeed": _patch_deepspeed, "labkit.rank.rendezvous": _patch_rendezvous,
           "deepspeed.ops.op_builder.builder": _patch_op_builder, "torch": _patch_torch}


class _ImportStamps:
    """A meta-path finder that finds nothing itself: it asks the others and times the module's execution."""

    def __init__(self):
        self.depth = dict.fromkeys(PACKAGES, 0)

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        timed = self.depth.get(top) == 0
        patch = PATCHES.get(name)
        if not timed and patch is None:
            return None
        begin = time.time()
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a class-level loader (builtins, frozen) is shared: not ours to wrap
        original = loader.exec_module

        def exec_module(module):
            if timed:
                self.depth[top] += 1
            try:
                original(module)
            finally:
                if timed:
                    self.depth[top] -= 1
                    _emit("import", begin, time.time(), name)
                loader.__dict__.pop("exec_module", None)
            if patch is not None:
                patch(module)

        loader.exec_module = exec_module
        return spec


if _DIR:
    _emit("up", time.time(), argv=getattr(sys, "orig_argv", None))
    sys.meta_path.insert(0, _ImportStamps())
