"""The client code of Flower's PyTorch quickstart, on Fashion-MNIST: a small
CNN, each client's partition of the training set, and a NumPyClient with
``get_parameters``, ``fit`` and ``evaluate``.

Nothing here imports flwr or cohort: the same object runs under
``cohort.simulate`` (``run_cohort.py``) and Flower's simulation
(``run_flower.py``). The data is read from ``$COHORT_DATA_DIR/fashion-mnist``
(IDX files, as cohort's data folder holds them).
"""

import gzip
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_CLIENTS = 100
BATCH_SIZE = 32
# One core per client process, as Flower's default client_resources give.
torch.set_num_threads(1)


class Net(nn.Module):
    """The quickstart's CNN (LeNet-like), for 1×28×28 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def data_dir():
    return Path(os.environ.get("COHORT_DATA_DIR", "../shared/data")) / "fashion-mnist"


def _idx(name):
    with gzip.open(data_dir() / name) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


_CACHE = {}


def split(kind):
    """``train`` or ``test``: the images as they are stored (uint8, shaped
    N×1×28×28) and the labels. Like the quickstart's transforms, which run
    per batch, the images are normalized one batch at a time (``to_input``),
    so the data set is held once, as bytes, not as float32."""
    if kind not in _CACHE:
        prefix = "train" if kind == "train" else "t10k"
        images = _idx(f"{prefix}-images-idx3-ubyte.gz")
        labels = _idx(f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
        _CACHE[kind] = (images[:, None], torch.from_numpy(labels))
    return _CACHE[kind]


def to_input(pixels):
    """A batch of uint8 pixels as the model's input: the quickstart's
    ``ToTensor()`` (to [0, 1]) and ``Normalize((0.5,), (0.5,))`` (to [-1, 1])."""
    return torch.from_numpy((pixels.astype(np.float32) / 255.0 - 0.5) / 0.5)


def load_partition(partition_id):
    """Client ``partition_id``'s IID share of the training set, 90% to train
    and 10% to validate, as the quickstart splits it."""
    images, labels = split("train")
    order = np.random.default_rng(42).permutation(len(labels))
    part = np.array_split(order, NUM_CLIENTS)[partition_id]
    cut = int(0.9 * len(part))
    return (images[part[:cut]], labels[part[:cut]]), (images[part[cut:]], labels[part[cut:]])


def train(net, data, epochs, learning_rate, seed):
    images, labels = data
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=learning_rate, momentum=0.9)
    net.train()
    total = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(order), BATCH_SIZE):
            batch = order[start:start + BATCH_SIZE]
            optimizer.zero_grad()
            loss = F.cross_entropy(net(to_input(images[batch.numpy()])), labels[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
    return total / (epochs * len(labels))


def test(net, data):
    images, labels = data
    net.eval()
    with torch.no_grad():
        # In batches of the training's size, as the quickstart's test loader:
        # a convolution's workspace grows with the batch (about 50 MiB at 1,000).
        logits = torch.cat([net(to_input(images[i:i + BATCH_SIZE]))
                            for i in range(0, len(labels), BATCH_SIZE)])
    loss = F.cross_entropy(logits, labels).item()
    accuracy = (logits.argmax(1) == labels).float().mean().item()
    return loss, accuracy


def get_weights(net):
    return [v.cpu().numpy() for v in net.state_dict().values()]


def set_weights(net, parameters):
    keys = net.state_dict().keys()
    net.load_state_dict(OrderedDict((k, torch.tensor(v)) for k, v in zip(keys, parameters)), strict=True)


class FlowerClient:
    """Flower's NumPyClient methods, duck-typed."""

    def __init__(self, partition_id):
        self.partition_id = partition_id
        # Every client builds the same initial model, so whichever one a
        # framework asks for the starting parameters, runs start alike.
        torch.manual_seed(0)
        self.net = Net()
        self.train_data, self.val_data = load_partition(partition_id)

    def get_parameters(self, config):
        return get_weights(self.net)

    def fit(self, parameters, config):
        set_weights(self.net, parameters)
        loss = train(self.net, self.train_data, int(config.get("local_epochs", 1)),
                     float(config.get("learning_rate", 0.01)),
                     int(config.get("seed", self.partition_id)) % (2**63))
        return get_weights(self.net), len(self.train_data[1]), {"train_loss": loss}

    def evaluate(self, parameters, config):
        set_weights(self.net, parameters)
        loss, accuracy = test(self.net, self.val_data)
        return loss, len(self.val_data[1]), {"accuracy": accuracy}


def client_fn(cid):
    return FlowerClient(int(cid))


def evaluate_fn(server_round, parameters, config):
    """The server's evaluation: the global model on the 10,000 test images."""
    net = Net()
    set_weights(net, parameters)
    loss, accuracy = test(net, split("test"))
    return loss, {"accuracy": accuracy}
