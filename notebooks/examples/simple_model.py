"""The model and data the three examples share (the source text repeats them in every example).

`SimpleModel` is the text's MLP (100 -> 500 -> 10 with the defaults) with its depth as a parameter:
`depth` hidden layers, 1 being the text's model. `teacher_data` replaces the text's random labels.
Random labels can be memorised (the training loss falls), but they hold nothing a held-out set can
measure: a model cannot predict the label of a sample it has not seen. Here a fixed random linear
"teacher" labels the inputs, so the held-out loss falls too, and "the same loss" means something.
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

INPUT_SIZE = 100  # the text's input_size and output_size
OUTPUT_SIZE = 10


class SimpleModel(nn.Module):
    def __init__(self, input_size, hidden_size, output_size, depth=1):
        super().__init__()
        layers = [nn.Linear(input_size, hidden_size), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden_size, hidden_size), nn.ReLU()]
        layers.append(nn.Linear(hidden_size, output_size))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


def teacher_data(num_samples, held_out=1000, seed=0, random_labels=False):
    """(train, held-out) datasets, the same on every rank (built from `seed`): inputs ~ N(0, 1),
    labels from a fixed random linear teacher; `random_labels=True` gives the text's labels."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples + held_out, INPUT_SIZE, generator=generator)
    teacher = torch.randn(INPUT_SIZE, OUTPUT_SIZE, generator=generator)
    if random_labels:
        labels = torch.randint(0, OUTPUT_SIZE, (num_samples + held_out,), generator=generator)
    else:
        labels = (inputs @ teacher).argmax(dim=1)
    return (TensorDataset(inputs[:num_samples], labels[:num_samples]),
            TensorDataset(inputs[num_samples:], labels[num_samples:]))


@torch.no_grad()
def held_out_loss(model, dataset, device, dtype=torch.float32):
    """Mean cross-entropy on `dataset` (every rank must call it under ZeRO-3: the forward gathers)."""
    inputs, labels = dataset.tensors
    outputs = model(inputs.to(device, dtype))
    return nn.functional.cross_entropy(outputs.float(), labels.to(device)).item()
