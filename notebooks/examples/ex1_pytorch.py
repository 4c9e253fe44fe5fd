"""Example 1 corrected: a plain PyTorch training loop, no DeepSpeed.

    python notebooks/examples/ex1_pytorch.py --steps 50
    labkit run --script notebooks/examples/ex1_pytorch.py --world-size 1 -- --steps 50

One process, on the accelerator torch finds (a CUDA GPU, ...) or else the CPU. Under `labkit run
--script` the same file runs supervised, with live charts: DeepSpeed's launcher passes --local_rank,
which a one-process script ignores, and `labkit.record` (a no-op outside labkit) streams each step.
"""

import argparse

import torch
import torch.nn as nn
from simple_model import INPUT_SIZE, OUTPUT_SIZE, SimpleModel, held_out_loss, teacher_data
from torch.utils.data import DataLoader

import labkit

parser = argparse.ArgumentParser(description="Example 1 corrected: plain PyTorch")
parser.add_argument("--steps", type=int, default=75, help="optimizer steps (the text: 5 epochs of 15)")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--hidden", type=int, default=500, help="hidden width (the text: 500)")
parser.add_argument("--depth", type=int, default=1, help="hidden layers (the text: 1)")
parser.add_argument("--num-samples", type=int, default=1000)
parser.add_argument("--lr", type=float, default=0.001)
parser.add_argument("--random-labels", action="store_true", help="the text's labels, to compare")
parser.add_argument("--local_rank", type=int, default=0, help="passed by DeepSpeed's launcher; unused")
args = parser.parse_args()

# The text never moves anything to a GPU: its loop runs on the CPU. torch.accelerator finds the device.
device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
torch.manual_seed(0)
train, held_out = teacher_data(args.num_samples, random_labels=args.random_labels)
dataloader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)

model = SimpleModel(INPUT_SIZE, args.hidden, OUTPUT_SIZE, args.depth).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

step = epoch = 0
while step < args.steps:
    for batch_data, batch_labels in dataloader:
        batch_data, batch_labels = batch_data.to(device), batch_labels.to(device)
        optimizer.zero_grad()
        outputs = model(batch_data)
        loss = criterion(outputs, batch_labels)
        loss.backward()
        optimizer.step()
        step += 1
        labkit.record(step=step, loss=loss.item())
        if step == args.steps:
            break
    epoch += 1
    print(f"Epoch {epoch}, step {step}: training loss {loss.item():.4f}, "
          f"held-out loss {held_out_loss(model, held_out, device):.4f}")
