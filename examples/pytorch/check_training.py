"""Every case that crates/cohort-train/tests/pytorch_twins.rs trained: the
PyTorch twin trained from the same initial model on the same batches, once in
float32 and once in float64, against cohort's trained model.

    python3 examples/pytorch/check_training.py DIR

DIR holds, per case, LABEL.json (the twin's build, SGD's settings, the batch
size and the sample order cohort's trainer drew), LABEL.initial.safetensors,
LABEL.data.safetensors (inputs, labels) and LABEL.trained.safetensors
(cohort's model after the steps), the models in PyTorch's layout.

Float32 rounding grows over training steps in any framework, so the float64
run is the reference: each case reports how far cohort's model and PyTorch's
float32 model are from it, as the L2 norm of the difference over every
floating-point tensor (BatchNorm's running statistics included; its
num_batches_tracked, which cohort writes as 0, is not compared) divided by
the L2 norm of the float64 run's own change from the initial model.

A ReLU whose input lies within rounding of zero opens in one float32 sum and
stays shut in another, and a single such gate moves a model by up to 1e-3 of
its change where the summation order alone moves it by 1e-6: which framework
meets one is chance. So each case also reports PyTorch's own float32 spread:
the farthest from the float64 run of PyTorch's float32 model and of
PERTURBED more float32 runs whose input values are moved by one unit in the
last place, at random (other roundings of the same sums, as another
framework's order gives); token inputs are not moved. Prints a
line per case, then the report as one line of JSON; exits 1 when a file does
not load or a case has no change to measure against.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from compare_logits import read_safetensors  # noqa: E402
from models import build  # noqa: E402


def twin(case, initial, dtype):
    model = build(case["model"], num_classes=case["classes"],
                  sample_shape=case["sample_shape"], **case["options"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()}, strict=True)
    return model.to(dtype)


def targets_of(case, inputs, labels):
    """One class per output row: the label, or with a row per position
    (next-token prediction) each next token and the label last, as cohort's
    NextToken task makes them."""
    if not case["next_token_rows"]:
        return labels
    return torch.cat([inputs[:, 1:].long(), labels[:, None]], dim=1).reshape(-1)


PERTURBED = 48


def perturbed(data, seed):
    """`data` with every input value moved one unit in its last place, up
    or down at random."""
    inputs = data["inputs"].astype(np.float32)
    rng = np.random.default_rng(seed)
    towards = np.where(rng.random(inputs.shape) < 0.5, -np.inf, np.inf).astype(np.float32)
    return {**data, "inputs": np.nextafter(inputs, towards)}


def train(case, initial, data, dtype):
    model = twin(case, initial, dtype)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=case["learning_rate"],
                                momentum=case["momentum"], weight_decay=case["weight_decay"])
    inputs = torch.from_numpy(data["inputs"])
    inputs = inputs.long() if case["tokens"] else inputs.to(dtype)
    labels = torch.from_numpy(data["labels"]).long()
    order = torch.tensor(case["order"], dtype=torch.int64)
    for start in range(0, len(order), case["batch_size"]):
        step = order[start:start + case["batch_size"]]
        logits = model(inputs[step])
        logits = logits.reshape(-1, logits.shape[-1])
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(logits, targets_of(case, inputs[step], labels[step])).backward()
        optimizer.step()
    state = model.state_dict()
    floats = {k: v.detach().double().numpy() for k, v in state.items() if v.is_floating_point()}
    counters = {k: v.detach().numpy() for k, v in state.items() if not v.is_floating_point()}
    return floats, counters


def distance(a, b, initial):
    change = sum(float(((b[k] - initial[k]) ** 2).sum()) for k in b)
    if change == 0.0:
        raise SystemExit("the float64 run did not move the model: nothing to compare")
    return (sum(float(((a[k] - b[k]) ** 2).sum()) for k in b) / change) ** 0.5


def check(directory, label):
    with open(os.path.join(directory, label + ".json")) as f:
        case = json.load(f)
    initial = read_safetensors(os.path.join(directory, label + ".initial.safetensors"))
    data = read_safetensors(os.path.join(directory, label + ".data.safetensors"))
    cohort = {k: v.astype(np.float64)
              for k, v in read_safetensors(os.path.join(directory, label + ".trained.safetensors")).items()}
    reference, counters = train(case, initial, data, torch.float64)
    single, _ = train(case, initial, data, torch.float32)
    start = {k: initial[k].astype(np.float64) for k in reference}
    spread = distance(single, reference, start)
    if not case["tokens"]:
        for seed in range(1, PERTURBED + 1):
            moved, _ = train(case, initial, perturbed(data, seed), torch.float32)
            spread = max(spread, distance(moved, reference, start))
    if set(cohort) != set(reference) | set(counters):
        raise SystemExit(f"{label}: cohort's tensors {sorted(cohort)} are not the twin's "
                         f"{sorted(set(reference) | set(counters))}")
    for name in counters:
        # BatchNorm's num_batches_tracked: cohort keeps no counter and writes
        # 0 (docs/ALGORITHMS.md, "BatchNorm"); PyTorch never reads it with a
        # momentum, so it is not compared.
        if np.any(cohort.pop(name) != 0):
            raise SystemExit(f"{label}: cohort's {name} is not the 0 it writes")
    worst = max(reference, key=lambda k: float(np.abs(cohort[k] - reference[k]).max()))
    return {
        "case": label,
        "worst_tensor": worst,
        "worst_tensor_max_abs": float(np.abs(cohort[worst] - reference[worst]).max()),
        "model": case["model"],
        "options": case["options"],
        "steps": -(-len(case["order"]) // case["batch_size"]),
        "cohort_from_float64": distance(cohort, reference, start),
        "pytorch_float32_from_float64": distance(single, reference, start),
        "pytorch_float32_spread": spread,
    }


def main():
    directory = sys.argv[1]
    labels = sorted(f[:-len(".json")] for f in os.listdir(directory) if f.endswith(".json"))
    report = []
    for label in labels:
        entry = check(directory, label)
        report.append(entry)
        print(f"{label} {entry['options']}: {entry['steps']} steps; from the float64 run: "
              f"cohort {entry['cohort_from_float64']:.2e}, PyTorch float32 "
              f"{entry['pytorch_float32_from_float64']:.2e} (spread {entry['pytorch_float32_spread']:.2e}); "
              f"cohort's largest difference "
              f"{entry['worst_tensor_max_abs']:.2e} in {entry['worst_tensor']}")
    print(f"torch {torch.__version__}")
    print(json.dumps(report))
    sys.exit(0 if report else 1)


if __name__ == "__main__":
    main()
