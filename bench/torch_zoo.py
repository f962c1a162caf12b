"""PyTorch's counterpart of cohort's zoo bench (crates/cohort-train/benches/zoo.rs).

Each zoo model's PyTorch twin (examples/pytorch/models.py) trains one epoch
over synthetic samples of its data set's shapes at batch 32 with SGD
(lr 0.01, momentum 0.9), eager mode; the line per model is
`model data shape samples/s`, best of --reps epochs after a warm-up epoch.

    python3 bench/torch_zoo.py [--device cpu|cuda] [--threads 1] [--samples 320]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "pytorch"))
from models import build  # noqa: E402

# (model, data set, sample shape, classes, options, token inputs), as zoo.rs.
CASES = [
    ("multilayer", "FashionMNIST", (1, 28, 28), 10, {}, False),
    ("cnn", "FashionMNIST", (1, 28, 28), 10, {}, False),
    ("cnn_femnist", "FEMNIST", (1, 28, 28), 62, {}, False),
    ("resnet_20", "CIFAR10", (3, 32, 32), 10, {"norm": "group"}, False),
    ("resnet_18", "CIFAR10", (3, 32, 32), 10, {}, False),
    ("vgg_11", "CIFAR10", (3, 32, 32), 10, {}, False),
    ("lstm_shakespeare", "Shakespeare", (80,), 80, {}, True),
]


def epoch(model, optimizer, x, y, batch, device):
    for start in range(0, len(x), batch):
        inputs, targets = x[start : start + batch], y[start : start + batch]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", help="comma-separated subset")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    chosen = set(args.models.split(",")) if args.models else None
    print(
        f"# torch {torch.__version__} zoo training, batch 32, {args.samples} samples an epoch, "
        f"best of {args.reps}, on {device} ({args.threads} thread(s))"
    )
    generator = torch.Generator().manual_seed(0)
    for name, data, shape, classes, options, tokens in CASES:
        if chosen is not None and name not in chosen:
            continue
        model = build(name, num_classes=classes, sample_shape=list(shape), **dict(options)).to(device)
        model.train()
        if tokens:
            x = torch.randint(0, classes, (args.samples, *shape), generator=generator)
        else:
            x = torch.rand((args.samples, *shape), generator=generator) * 2 - 1
        y = torch.arange(args.samples) % classes
        x, y = x.to(device), y.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        epoch(model, optimizer, x, y, 32, device)
        best = float("inf")
        for _ in range(args.reps):
            started = time.perf_counter()
            epoch(model, optimizer, x, y, 32, device)
            best = min(best, time.perf_counter() - started)
        print(f"{name} {data} {list(shape)} {args.samples / best:.1f}")


if __name__ == "__main__":
    main()
