"""A plain DeepSpeed training script, as a learner writes it (run by tests/launch/test_own_model.py).

    deepspeed ds_train.py --steps 6 [--record] [--fail-rank 1 --fail-step 3] [--abort-rank 1 [--abort-step 3]]
                          [--sleep-s 0.2]

With --record it adds labkit's one line per step; without it, it knows nothing of labkit.
--abort-rank: that rank calls os.abort() (SIGABRT) after recording step --abort-step, or without a
step at exit, after every other atexit hook, as the C++ teardown abort of gloo / DeepSpeed threads does.
--sleep-s: a pause after each step (a run long enough to be stopped).
"""

import argparse
import atexit
import os
import time

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--record", action="store_true")
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-step", type=int, default=None)
parser.add_argument("--abort-rank", type=int, default=None)
parser.add_argument("--abort-step", type=int, default=None)
parser.add_argument("--sleep-s", type=float, default=0.0)
args = parser.parse_args()
if args.abort_rank == int(os.environ["RANK"]) and args.abort_step is None:
    atexit.register(os.abort)  # registered first, so it runs last (atexit is last-in first-out)

deepspeed.init_distributed()
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
config = {"train_batch_size": 16 * torch.distributed.get_world_size(), "train_micro_batch_size_per_gpu": 16,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
inputs = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank))
labels = (inputs[:, :4]).argmax(dim=1)
for step in range(1, args.steps + 1):
    if args.fail_rank == rank and args.fail_step == step:
        raise ValueError(f"bad batch at step {step}")
    loss = torch.nn.functional.cross_entropy(engine(inputs), labels)
    engine.backward(loss)
    engine.step()
    if args.record:
        import labkit

        labkit.record(step=step, loss=loss.item())
    if args.abort_rank == rank and args.abort_step == step:
        os.abort()
    time.sleep(args.sleep_s)
deepspeed.comm.destroy_process_group()
