#!/usr/bin/env python3
"""GPU reference for vectorized clients of a zoo model: K clients of `cnn`,
`cnn_femnist`, `multilayer` or `resnet_20` (GroupNorm, 2 groups: the stacked
form cohort has) trained by PyTorch, the method of
torch_clients_gpu.py (which does it for LeNet-5) applied to cohort's PyTorch
twins (examples/pytorch/models.py).

Each client has its own copy of the model, its own 6,000-sample partition of
Fashion-MNIST (synthetic inputs of the same shape when the files are absent),
batch 32, SGD lr 0.01 momentum 0.9, one local epoch: what a round of
configs/fashion_mnist/vectorized_100.toml asks of its clients. Three ways:

  sequential  one client after the other, eager (timed on 20 clients at most:
              its cost is linear in K)
  vmap        all K clients as one batched computation: stack_module_state +
              vmap(grad_and_value(functional_call)) + a stacked SGD-momentum
              update (the model-ensembling recipe of the PyTorch docs)
  vmap-graph  vmap inside a captured CUDA graph (one replay per step)

Prints one JSON line per (mode, K) with local-training samples/s, the data
already on the GPU. Needs torch with CUDA and numpy.

    python3 bench/torch_zoo_vmap.py --model cnn [--data DIR/fashion-mnist] [--clients 100]
"""

import argparse
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from models import build  # noqa: E402

MODELS = ["cnn", "cnn_femnist", "lenet5", "multilayer", "resnet_20"]
# The options cohort's run of gpu_vectorized.sh gives each model.
OPTIONS = {"resnet_20": {"norm": "group"}}


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = struct.unpack(">I", raw[:4])[0] & 0xFF
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_train(data, classes):
    path = os.path.join(data or "", "train-images-idx3-ubyte.gz")
    if data and os.path.exists(path):
        x = read_idx(path).astype(np.float32) / 255.0
        y = read_idx(os.path.join(data, "train-labels-idx1-ubyte.gz")).astype(np.int64)
        return torch.from_numpy((x - 0.5) / 0.5).unsqueeze(1), torch.from_numpy(y), "fashion-mnist"
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(60000, 1, 28, 28, generator=generator) * 2 - 1
    return x, torch.randint(0, classes, (60000,), generator=generator), "synthetic"


def client_batches(k_clients, n, batch, device):
    """Index tensor [steps, K, batch]: client k's shuffled partition, full batches only."""
    steps = n // batch
    idx = torch.empty(steps, k_clients, batch, dtype=torch.long)
    for k in range(k_clients):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(k)) + (k % 10) * n
        idx[:, k, :] = perm[: steps * batch].view(steps, batch)
    return idx.to(device)


def sequential(make, x, y, idx, lr=0.01, momentum=0.9):
    steps, k_clients, _ = idx.shape
    for k in range(k_clients):
        model = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        for s in range(steps):
            b = idx[s, k]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[b]), y[b]).backward()
            optimizer.step()


def make_vmap_step(make, k_clients, lr=0.01, momentum=0.9):
    params, _ = stack_module_state([make() for _ in range(k_clients)])
    base = make().to("meta")
    velocity = {name: torch.zeros_like(p) for name, p in params.items()}

    def loss(p, xb, yb):
        return F.cross_entropy(functional_call(base, p, (xb,)), yb)

    grads_of = vmap(grad_and_value(loss))

    def step(xb, yb):  # xb [K, B, 1, 28, 28], yb [K, B]
        grads, _ = grads_of(params, xb, yb)
        with torch.no_grad():
            for name in params:
                velocity[name].mul_(momentum).add_(grads[name])
                params[name].sub_(lr * velocity[name])

    return step


def vmap_run(make, x, y, idx, graph):
    steps, k_clients, _ = idx.shape
    step = make_vmap_step(make, k_clients)
    if not graph:
        for s in range(steps):
            b = idx[s]
            step(x[b], y[b])
        return
    static_x, static_y = x[idx[0]].clone(), y[idx[0]].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up before capture (these steps also train)
            step(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        step(static_x, static_y)
    for s in range(steps):
        b = idx[s]
        static_x.copy_(x[b])
        static_y.copy_(y[b])
        captured.replay()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=MODELS)
    # Fashion-MNIST's 10, as cohort's run of gpu_vectorized.sh has for every
    # model (cnn_femnist's head included).
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--data", default="")
    parser.add_argument("--clients", default="100")
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--modes", default="sequential,vmap,vmap-graph")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    classes = args.classes
    x, y, source = load_train(args.data, classes)
    x, y = x.to(device), y.to(device)

    def make():
        options = OPTIONS.get(args.model, {})
        return build(args.model, num_classes=classes, sample_shape=[1, 28, 28], **options).to(device)

    for k_clients in [int(v) for v in args.clients.split(",")]:
        idx = client_batches(k_clients, args.samples, args.batch, device)
        for mode in args.modes.split(","):
            if mode == "vmap-graph" and device.type != "cuda":
                continue
            idx_run = idx[:, :20] if mode == "sequential" and k_clients > 20 else idx
            graph = mode == "vmap-graph"
            run = (lambda: sequential(make, x, y, idx_run)) if mode == "sequential" else (
                lambda: vmap_run(make, x, y, idx_run, graph))
            run()  # warm-up: kernel selection, allocator
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            samples = idx_run.shape[0] * idx_run.shape[1] * idx_run.shape[2]
            print(json.dumps({"model": args.model, "mode": mode, "clients": idx_run.shape[1],
                              "batch": args.batch, "data": source,
                              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "seconds": round(seconds, 3), "samples_per_s": round(samples / seconds)}),
                  flush=True)


if __name__ == "__main__":
    main()
