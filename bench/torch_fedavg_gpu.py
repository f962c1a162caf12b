#!/usr/bin/env python3
"""The whole of configs/fashion_mnist/vectorized_100.toml in PyTorch, timed end
to end: what a user of PyTorch runs to get what `cohort run --gpu` gives.

torch_clients_gpu.py and torch_zoo_vmap.py time one round's local training
after a warm-up. A first run also pays for what comes before and between
rounds, and so does cohort's figure it is compared with (docs/BENCHMARKS.md,
"A first GPU run"): importing torch and starting CUDA, reading the IDX files,
building the clients, capturing the CUDA graph, and each round sending the
global model to the clients, averaging their models (FedAvg, equal weights:
equal partitions) and evaluating the average on the test set. This script
does all of it with the fastest method of those scripts, vmap of the clients
inside a captured CUDA graph, one replay a step, and prints one JSON line a
round and one for the run (seconds since the script started, before `import
torch`; the shell around it adds the interpreter's own start).

The work is cohort's: K clients of `--samples` samples (iid_cyclic as
cohort builds it: a seeded shuffle of the training set repeated end to end,
client c taking every K-th position from c; torch's shuffle, not cohort's
ChaCha8 one), each client's samples in a new order every round, batch 32, SGD lr 0.01 momentum 0.9 with a fresh
velocity every round, one local epoch, `--rounds` rounds. Only full batches
are trained (187 steps of 32 for 6,000 samples; cohort's 188th step trains
the last 16): a CUDA graph replays one shape.

    python3 bench/torch_fedavg_gpu.py --data DIR/fashion-mnist [--model lenet5]
        [--clients 100] [--rounds 10]

Needs torch with CUDA and numpy; the models are cohort's PyTorch twins
(examples/pytorch/models.py).
"""

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad_and_value, stack_module_state, vmap  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from models import build  # noqa: E402
from torch_zoo_vmap import read_idx  # noqa: E402  (this folder: the same IDX reader)

OPTIONS = {"resnet_20": {"norm": "group"}}


def load(data, prefix, device):
    images = read_idx(os.path.join(data, f"{prefix}-images-idx3-ubyte.gz")).astype(np.float32) / 255.0
    labels = read_idx(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz")).astype(np.int64)
    images = torch.from_numpy((images - 0.5) / 0.5).unsqueeze(1).to(device)
    return images, torch.from_numpy(labels).to(device)


def since_start():
    return round(time.perf_counter() - STARTED, 3)


class Federation:
    """K stacked clients, their velocities, and one captured training step."""

    def __init__(self, make, k_clients, lr, momentum):
        self.global_model = make()
        self.params, _ = stack_module_state([make() for _ in range(k_clients)])
        self.velocity = {name: torch.zeros_like(p) for name, p in self.params.items()}
        base = make().to("meta")

        def loss(p, xb, yb):
            return F.cross_entropy(functional_call(base, p, (xb,)), yb)

        grads_of = vmap(grad_and_value(loss))

        def step(xb, yb):
            grads, _ = grads_of(self.params, xb, yb)
            with torch.no_grad():
                for name in self.params:
                    self.velocity[name].mul_(momentum).add_(grads[name])
                    self.params[name].sub_(lr * self.velocity[name])

        self.step = step
        self.graph = None

    @torch.no_grad()
    def send_global(self):
        """Every client starts the round from the global model, velocity zero
        (in place: the captured graph holds these tensors)."""
        for name, value in self.global_model.named_parameters():
            self.params[name].copy_(value.unsqueeze(0).expand_as(self.params[name]))
            self.velocity[name].zero_()

    def capture(self, static_x, static_y):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up before capture; send_global undoes it
                self.step(static_x, static_y)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step(static_x, static_y)

    @torch.no_grad()
    def average(self):
        for name, value in self.global_model.named_parameters():
            value.copy_(self.params[name].mean(0))


@torch.no_grad()
def accuracy(model, images, labels, batch=1000):
    model.eval()
    correct = 0
    for start in range(0, len(labels), batch):
        logits = model(images[start:start + batch])
        correct += (logits.argmax(1) == labels[start:start + batch]).sum()
    model.train()
    return correct.item() / len(labels)


def iid_cyclic(k_clients, samples, train_len, generator, device):
    """[K, samples] sample indices: cohort's iid_cyclic (core's partition.rs),
    client c at position j holding shuffled[(c + j·K) mod N]."""
    shuffled = torch.randperm(train_len, generator=generator, device=device)
    clients = torch.arange(k_clients, device=device).unsqueeze(1)
    positions = torch.arange(samples, device=device) * k_clients
    return shuffled[(clients + positions) % train_len]


def round_batches(partition, batch, generator, device):
    """[steps, K, batch] sample indices: each client's partition in a new
    order, full batches only."""
    k_clients, samples = partition.shape
    order = torch.rand(k_clients, samples, generator=generator, device=device).argsort(1)
    steps = samples // batch
    shuffled = partition.gather(1, order)[:, : steps * batch]
    return shuffled.view(k_clients, steps, batch).transpose(0, 1).contiguous()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="folder of Fashion-MNIST's IDX files")
    parser.add_argument("--model", default="lenet5")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cpu", action="store_true",
                        help="check the script without a GPU: eager steps, no graph, not a reference")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("torch_fedavg_gpu.py: CUDA is not available; this reference is a GPU one (--cpu checks the script)")
    device = torch.device("cpu" if args.cpu else "cuda")
    torch.manual_seed(1)
    x, y = load(args.data, "train", device)
    test_x, test_y = load(args.data, "t10k", device)

    def make():
        options = OPTIONS.get(args.model, {})
        return build(args.model, num_classes=10, sample_shape=[1, 28, 28], **options).to(device)

    federation = Federation(make, args.clients, lr=0.01, momentum=0.9)
    generator = torch.Generator(device=device).manual_seed(1)
    partition = iid_cyclic(args.clients, args.samples, len(y), generator, device)
    static_x = x[: args.clients * args.batch].view(args.clients, args.batch, *x.shape[1:]).clone()
    static_y = y[: args.clients * args.batch].view(args.clients, args.batch).clone()
    if not args.cpu:
        federation.capture(static_x, static_y)
    print(json.dumps({"ready_s": since_start(),
                      "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
                      "torch": torch.__version__, "train_samples": len(y)}), flush=True)
    trained = 0
    for round_number in range(1, args.rounds + 1):
        round_started = time.perf_counter()
        federation.send_global()
        batches = round_batches(partition, args.batch, generator, device)
        for step_batch in batches:
            static_x.copy_(x[step_batch])
            static_y.copy_(y[step_batch])
            if federation.graph is None:
                federation.step(static_x, static_y)
            else:
                federation.graph.replay()
        federation.average()
        acc = accuracy(federation.global_model, test_x, test_y)  # synchronizes
        trained += batches.numel()
        print(json.dumps({"round": round_number, "seconds": round(time.perf_counter() - round_started, 3),
                          "accuracy": round(acc, 4)}), flush=True)
    total = since_start()
    print(json.dumps({"model": args.model, "clients": args.clients, "rounds": args.rounds,
                      "end_to_end_s": total, "samples_trained": trained,
                      "samples_per_s_end_to_end": round(trained / total)}), flush=True)


if __name__ == "__main__":
    main()
