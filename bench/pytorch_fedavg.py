#!/usr/bin/env python3
"""Plain PyTorch FedAvg on the same work as a finished cohort run, to hold
cohort's accuracy against a reference.

It reads the run folder cohort wrote: its config.toml (model, optimizer,
batch size, epochs), clients.csv (which clients trained in each round; a
client dropped there is left out here too) and results.csv (cohort's
accuracy, to compare with); and the exact client → sample assignment from
`cohort partitions --config RUN/config.toml --json FILE`. Each round, each
of that round's clients trains a copy of the global model on its own samples
(shuffled each epoch, batches of trainer.batch_size, the last one partial,
as cohort does), and the global model becomes the sample-weighted mean of
their models (every floating-point tensor of the state dict, BatchNorm's
running statistics included; its integer counters take the clients' sum).

The initial model: the file `--initial-model` names, else the run's own
`trainer.initial_model` when its config.toml sets one (a relative path is
taken from the current folder, as cohort took it from its own), loaded
into the PyTorch twin with `load_state_dict(strict=True)`; then both sides
start from the same weights bit for bit. Without either, PyTorch draws its
own after `torch.manual_seed(--seed)`. `--write-initial FILE` writes that
draw as a model file in PyTorch's layout and exits, so cohort can be given
it (`--set trainer.initial_model=FILE`) before it runs.

The sample order: when the partitions file was written with
`cohort partitions --sample-orders`, each client here visits its samples in
the very order cohort's trainer drew for that client, round and epoch, so
with a shared initial model both frameworks train the same batches from the
same weights and differ only by floating-point rounding. Otherwise each
framework shuffles with its own generator, and the runs agree in
distribution, not step for step.

Usage:
  cohort check --config job.toml > job-full.toml    # optional: a shared start
  python3 bench/pytorch_fedavg.py --write-initial initial.safetensors \
      --config job-full.toml [--seed N]
  cohort run --config job.toml --set trainer.initial_model=initial.safetensors
  cohort partitions --config RUN/config.toml --json parts.json
  python3 bench/pytorch_fedavg.py --run RUN --partitions parts.json \
      --data DATA_DIR [--initial-model FILE] [--device cpu|cuda] [--threads N] \
      [--tf32] [--cudnn-benchmark] [--seed N] [--out result.json]
Needs torch and numpy (pip install torch numpy), not the safetensors
package; the models are examples/pytorch/models.py.
"""

import argparse
import csv
import gzip
import json
import os
import struct
import sys
import time
import tomllib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "pytorch"))
from compare_logits import read_safetensors  # noqa: E402
from models import build  # noqa: E402

# cohort reads these IDX files for its MNIST-family data sets, and
# normalizes both with MNIST's statistics (crates/cohort-core/src/data/mod.rs).
FOLDERS = {"FashionMNIST": "fashion-mnist", "MNIST": "mnist"}
MEAN, STD = 0.1307, 0.3081


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_split(root, datasource, prefix):
    folder = os.path.join(root, FOLDERS[datasource])

    def find(kind, dims):
        name = os.path.join(folder, f"{prefix}-{kind}-idx{dims}-ubyte")
        for path in (name + ".gz", name):
            if os.path.exists(path):
                return path
        raise SystemExit(f"no {name}[.gz]")

    images = read_idx(find("images", 3)).astype(np.float32) / 255.0
    labels = read_idx(find("labels", 1)).astype(np.int64)
    x = torch.from_numpy((images - MEAN) / STD).unsqueeze(1)
    return x, torch.from_numpy(labels)


# The model's sample shape, by data set (the ones this script reads).
SAMPLE_SHAPE = {"FashionMNIST": [1, 28, 28], "MNIST": [1, 28, 28]}
SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}


def build_model(config):
    """The PyTorch twin of the run's `trainer.model_name` with its
    `[parameters.model]` options, drawn from torch's global generator."""
    model_options = dict(config.get("parameters", {}).get("model", {}))
    classes = model_options.pop("num_classes", 10)
    name = config["trainer"].get("model_name", "lenet5")
    datasource = config["data"]["datasource"]
    if datasource not in SAMPLE_SHAPE:
        raise SystemExit(f"data.datasource = {datasource!r} is not read by this script")
    shape = SAMPLE_SHAPE[datasource]
    return name, build(name, num_classes=classes, sample_shape=shape, **model_options)


def write_safetensors(path, state):
    """`state` (a state dict) as a safetensors file, with numpy alone: a
    little-endian u64 header length, the JSON header padded with spaces to 8
    bytes, then the tensors' little-endian bytes back to back in order."""
    header, blobs, offset = {}, [], 0
    for name, tensor in state.items():
        array = np.ascontiguousarray(tensor.detach().cpu().numpy())
        if array.dtype not in SAFETENSORS_DTYPES:
            raise SystemExit(f"{name}: {array.dtype} is not written by this script")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


def load_initial(model, path):
    """The model file at `path` loaded into `model` with strict=True (every
    name and shape the twin's, nothing more)."""
    state = {k: torch.from_numpy(v) for k, v in read_safetensors(path).items()}
    model.load_state_dict(state, strict=True)
    return len(state)


def optimizer_of(config, params):
    name = config["trainer"].get("optimizer", "sgd").lower()
    options = config.get("parameters", {}).get("optimizer", {})
    lr = options["learning_rate"]
    if name in ("sgd", "momentum"):
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=options.get("momentum", 0.0),
            dampening=options.get("dampening", 0.0),
            weight_decay=options.get("weight_decay", 0.0),
            nesterov=options.get("nesterov", False),
        )
    if name == "adam":
        betas = tuple(options.get("betas", [0.9, 0.999]))
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=options.get("eps", 1e-8))
    raise SystemExit(f"trainer.optimizer = {name!r} is not mapped to PyTorch here")


def selected_clients(run_dir):
    """(round, its clients whose updates cohort aggregated, in file order),
    by round."""
    rounds = {}
    with open(os.path.join(run_dir, "clients.csv")) as f:
        for row in csv.DictReader(f):
            if row["dropped"]:
                continue
            rounds.setdefault(int(row["round"]), []).append(int(row["client_id"]))
    return [(r, rounds[r]) for r in sorted(rounds)]


def cohort_accuracies(run_dir):
    with open(os.path.join(run_dir, "results.csv")) as f:
        return [float(row["accuracy"]) for row in csv.DictReader(f)]


def sample_orders(assignment, config):
    """Each client's cohort-drawn orders (`orders[round - 1][epoch - 1]`),
    or None when the partitions file has none; refused when they were drawn
    for other settings than the run's."""
    drawn = assignment.get("sample_orders")
    if drawn is None:
        return None
    trainer = config["trainer"]
    run = {
        "training_seed": trainer.get("training_seed"),
        "epochs": trainer.get("epochs", 1),
        "batch_size": trainer.get("batch_size", 32),
    }
    for key, value in run.items():
        if drawn[key] != value:
            raise SystemExit(
                f"the partitions' sample orders were drawn for {key} = {drawn[key]}, "
                f"the run has {value}"
            )
    if drawn["rounds"] < trainer.get("rounds", 1):
        raise SystemExit(
            f"the partitions' sample orders cover {drawn['rounds']} rounds, the run has "
            f"{trainer.get('rounds', 1)}: write them from the run's own config.toml"
        )
    return {c["client_id"]: c["orders"] for c in assignment["clients"]}


def train_client(model, config, x, y, indices, device, generator, orders=None):
    """One client's local training: in `orders[epoch]` (cohort's) when given,
    else shuffled each epoch by `generator`."""
    trainer = config["trainer"]
    batch = trainer.get("batch_size", 32)
    optimizer = optimizer_of(config, model.parameters())
    model.train()
    order = torch.tensor(indices, dtype=torch.int64)
    for epoch in range(trainer.get("epochs", 1)):
        if orders is None:
            order = order[torch.randperm(len(order), generator=generator)]
        else:
            order = torch.tensor(orders[epoch], dtype=torch.int64)
        for start in range(0, len(order), batch):
            step = order[start : start + batch]
            inputs, targets = x[step].to(device), y[step].to(device)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fedavg(states, weights):
    total = float(sum(weights))
    averaged = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            averaged[key] = sum(s[key] * (w / total) for s, w in zip(states, weights))
        else:
            averaged[key] = sum(s[key] for s in states)
    return averaged


def model_differences(model, path):
    """Each tensor's largest absolute difference between `model` and
    cohort's final model file (and the tensor's largest magnitude, its
    scale); None when the run wrote none. From the same initial model and
    sample order, these are floating-point rounding, grown over the run."""
    if not os.path.exists(path):
        return None
    theirs = read_safetensors(path)
    ours = model.state_dict()
    differences = {}
    for name, tensor in ours.items():
        if name not in theirs:
            raise SystemExit(f"{path} has no tensor {name}")
        mine = tensor.detach().cpu().double().numpy()
        other = theirs[name].astype(np.float64)
        differences[name] = {
            "max_abs": float(np.max(np.abs(mine - other))) if mine.size else 0.0,
            "scale": float(np.max(np.abs(other))) if other.size else 0.0,
        }
    return differences


@torch.no_grad()
def accuracy(model, x, y, device, batch=1000):
    model.eval()
    correct = 0
    for start in range(0, len(x), batch):
        logits = model(x[start : start + batch].to(device))
        correct += (logits.argmax(1).cpu() == y[start : start + batch]).sum().item()
    return correct / len(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="a finished cohort run folder")
    parser.add_argument("--partitions", help="cohort partitions --json output")
    parser.add_argument("--data", help="the data folder cohort read")
    parser.add_argument(
        "--initial-model",
        help="start from this model file (safetensors, PyTorch's layout); "
        "default: the run's trainer.initial_model, if set",
    )
    parser.add_argument(
        "--write-initial",
        metavar="FILE",
        help="write the twin drawn after torch.manual_seed(--seed) to FILE and exit "
        "(needs --config)",
    )
    parser.add_argument(
        "--config", help="with --write-initial: a cohort config with every default (cohort check)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="on CUDA, let convolutions and products round their inputs to TF32 "
        "(PyTorch's default for cuDNN convolutions); without it every product is float32, "
        "as cohort's",
    )
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="on CUDA, let cuDNN choose each convolution's algorithm by timing "
        "(torch.backends.cudnn.benchmark): the same arithmetic, another summation order",
    )
    parser.add_argument("--out", help="write the comparison here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Float32 on both sides unless asked: cuDNN's convolutions take TF32
    # inputs by default on Ampere and later, a 10-bit mantissa.
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(args.seed)
    if args.write_initial:
        if not args.config:
            parser.error("--write-initial needs --config")
        with open(args.config, "rb") as f:
            config = tomllib.load(f)
        name, model = build_model(config)
        write_safetensors(args.write_initial, model.state_dict())
        print(f"{args.write_initial}: {name}, torch.manual_seed({args.seed})", file=sys.stderr)
        return
    missing = [f"--{k}" for k in ("run", "partitions", "data") if getattr(args, k) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required")
    with open(os.path.join(args.run, "config.toml"), "rb") as f:
        config = tomllib.load(f)
    with open(args.partitions) as f:
        assignment = json.load(f)
    datasource = config["data"]["datasource"]
    if assignment["datasource"] != datasource:
        raise SystemExit(f"{args.partitions} is of {assignment['datasource']}, the run of {datasource}")
    if datasource not in FOLDERS:
        raise SystemExit(f"data.datasource = {datasource!r} is not read by this script")
    train_x, train_y = load_split(args.data, datasource, "train")
    test_x, test_y = load_split(args.data, datasource, "t10k")
    partitions = {c["client_id"]: c["train"] for c in assignment["clients"]}
    orders = sample_orders(assignment, config)
    print(
        "sample order: " + ("cohort's (--sample-orders)" if orders else "PyTorch's own shuffles"),
        file=sys.stderr,
    )
    device = torch.device(args.device)
    name, model = build_model(config)
    initial = args.initial_model or config["trainer"].get("initial_model")
    if initial:
        tensors = load_initial(model, initial)
        print(f"initial model: {initial} ({tensors} tensors, strict load)", file=sys.stderr)
    model = model.to(device)
    generator = torch.Generator().manual_seed(args.seed)
    initial_accuracy = accuracy(model, test_x, test_y, device)
    print(f"round 0: accuracy {initial_accuracy:.4f}", file=sys.stderr)
    ours = []
    started = time.perf_counter()
    for round_number, round_clients in selected_clients(args.run):
        global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        states, weights = [], []
        for client in round_clients:
            model.load_state_dict(global_state)
            indices = partitions[client]
            client_orders = orders[client][round_number - 1] if orders else None
            states.append(
                train_client(
                    model, config, train_x, train_y, indices, device, generator, client_orders
                )
            )
            weights.append(len(indices))
        model.load_state_dict(fedavg(states, weights))
        ours.append(accuracy(model, test_x, test_y, device))
        print(f"round {len(ours)}: accuracy {ours[-1]:.4f}", file=sys.stderr)
    theirs = cohort_accuracies(args.run)
    differences = model_differences(model, os.path.join(args.run, "model.safetensors"))
    if differences:
        worst = max(differences, key=lambda k: differences[k]["max_abs"])
        print(
            f"final model against cohort's: largest difference {differences[worst]['max_abs']:.3g} "
            f"in {worst} (scale {differences[worst]['scale']:.3g})",
            file=sys.stderr,
        )
    result = {
        "model": name,
        "initial_model": initial,
        "sample_order": "cohort" if orders else "own",
        "device": args.device,
        "tf32": args.tf32,
        "cudnn_benchmark": args.cudnn_benchmark,
        "rounds": len(ours),
        "pytorch_final": ours[-1],
        "cohort_final": theirs[-1],
        "difference_points": 100 * (theirs[-1] - ours[-1]),
        "pytorch_initial_accuracy": initial_accuracy,
        "pytorch_accuracy": ours,
        "cohort_accuracy": theirs,
        "pytorch_seconds": time.perf_counter() - started,
        "final_model_differences": differences,
    }
    print(
        f"| {name} | {len(ours)} | {theirs[-1]:.4f} | {ours[-1]:.4f} | "
        f"{result['difference_points']:+.2f} |"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
