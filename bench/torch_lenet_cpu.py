#!/usr/bin/env python3
"""The work of crates/cohort-train/benches/lenet_cpu.rs in eager PyTorch, one thread.

LeNet-5 (the classic layout of ../shared/bench/torch_r1.py), synthetic images:
one client's local training (6,000 samples, batch 32, SGD lr 0.01 momentum 0.9)
and a 10,000-sample evaluation at batch 1,000, each the best of 3, in thread
CPU time (as the Rust bench), so that other processes on a shared machine
disturb the ratio less.
Usage: python3 bench/torch_lenet_cpu.py [--threads 1] [--reps 3]
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.conv3 = nn.Conv2d(16, 120, 5)
        self.fc4 = nn.Linear(120, 84)
        self.fc5 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x)).flatten(1)
        return self.fc5(F.relu(self.fc4(x)))


def images(count):
    i = torch.arange(count * 784, dtype=torch.int64)
    x = ((i * 7919) % 255).to(torch.float32) / 255.0 - 0.5
    return x.reshape(count, 1, 28, 28), torch.arange(count) % 10


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    model, loss_fn = LeNet5(), nn.CrossEntropyLoss()
    xtr, ytr = images(6000)
    train = []
    for _ in range(a.reps):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        perm = torch.randperm(6000)
        start = time.thread_time()
        for i in range(0, 6000, 32):
            b = perm[i : i + 32]
            opt.zero_grad()
            loss_fn(model(xtr[b]), ytr[b]).backward()
            opt.step()
        train.append(time.thread_time() - start)
    xte, yte = images(10_000)
    evals = []
    with torch.no_grad():
        for _ in range(a.reps):
            start = time.thread_time()
            correct = 0
            for i in range(0, 10_000, 1000):
                correct += (model(xte[i : i + 1000]).argmax(1) == yte[i : i + 1000]).sum().item()
            evals.append(time.thread_time() - start)
    print(f"torch {torch.__version__}: training {6000 / min(train):.0f} samples/s per core "
          f"(best of {a.reps}, worst {6000 / max(train):.0f})")
    print(f"torch {torch.__version__}: evaluation of 10,000 samples {min(evals):.3f} s "
          f"(best of {a.reps}, worst {max(evals):.3f})")


if __name__ == "__main__":
    main()
