"""Example 3 corrected: DeepSpeed ZeRO stage 3 on N ranks (GPUs, or CPU ranks with gloo).

    deepspeed --num_gpus 2 notebooks/examples/ex3_zero3.py --steps 20
    labkit run --script notebooks/examples/ex3_zero3.py --world-size 2 -- --steps 20

The DeepSpeed config is ex3_ds_config.json beside this file unless --deepspeed_config names another;
it sets the micro-batch per rank, and DeepSpeed derives the global batch: micro x accumulation x ranks.
The precision is the config's (fp32 as committed; set "bf16": {"enabled": true} on a GPU that has it).
"""

import argparse
import os
from pathlib import Path

import deepspeed
import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from simple_model import INPUT_SIZE, OUTPUT_SIZE, SimpleModel, held_out_loss, teacher_data
from torch.utils.data import DataLoader, DistributedSampler

import labkit

parser = argparse.ArgumentParser(description="Example 3 corrected: ZeRO-3 on N ranks")
parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
parser.add_argument("--hidden", type=int, default=500, help="hidden width (the text: 500)")
parser.add_argument("--depth", type=int, default=1, help="hidden layers (the text: 1)")
parser.add_argument("--num-samples", type=int, default=1000)
parser.add_argument("--random-labels", action="store_true", help="the text's labels, to compare")
parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
parser = deepspeed.add_config_arguments(parser)  # --deepspeed_config
args = parser.parse_args()
args.deepspeed_config = args.deepspeed_config or str(Path(__file__).with_name("ex3_ds_config.json"))

get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))  # this rank's GPU (a no-op on CPU ranks)
deepspeed.init_distributed()  # the accelerator's backend: NCCL on GPUs, gloo on CPU ranks
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
train, held_out = teacher_data(args.num_samples, random_labels=args.random_labels)

# Each parameter is partitioned as it is created: a model too big for one device can be built at all.
with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
    model = SimpleModel(INPUT_SIZE, args.hidden, OUTPUT_SIZE, args.depth)
criterion = nn.CrossEntropyLoss()
model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
dtype, _ = model_engine.get_data_types()  # the config's precision: bf16 or fp16 if it enables one, else fp32

# Each rank reads its own 1/N of the data, in a new order every epoch (set_epoch).
sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
dataloader = DataLoader(train, batch_size=model_engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                        drop_last=True)
adam = type(getattr(optimizer, "optimizer", optimizer)).__name__  # the Adam DeepSpeed chose, inside ZeRO's wrapper
if rank == 0:
    print(f"{world_size} rank(s), global batch {model_engine.train_batch_size()}, "
          f"{len(dataloader) // model_engine.gradient_accumulation_steps()} steps per epoch, optimizer {adam}")

step = epoch = 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for batch_data, batch_labels in dataloader:
        batch_data = batch_data.to(model_engine.device, dtype)
        batch_labels = batch_labels.to(model_engine.device)
        outputs = model_engine(batch_data)
        loss = criterion(outputs.float(), batch_labels)
        model_engine.backward(loss)
        model_engine.step()  # an optimizer step once every gradient_accumulation_steps micro-batches
        if model_engine.global_steps > step:
            step = model_engine.global_steps
            labkit.record(step=step, loss=loss.item())
            if step == args.steps:
                break
    epoch += 1
    evaluated = held_out_loss(model_engine, held_out, model_engine.device, dtype)  # every rank: ZeRO-3 gathers
    if rank == 0:
        print(f"Epoch {epoch}, step {step}: training loss {loss.item():.4f}, held-out loss {evaluated:.4f}")
dist.destroy_process_group()
