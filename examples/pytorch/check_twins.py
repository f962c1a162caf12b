"""Every case that crates/cohort-train/tests/pytorch_twins.rs wrote: cohort's
model file loaded into its PyTorch twin with strict=True, and the twin's
logits against cohort's on the same inputs.

    python3 examples/pytorch/check_twins.py DIR

DIR holds, per case, LABEL.json (model, sample shape, classes, options),
LABEL.model.safetensors (cohort's model file) and LABEL.io.safetensors
(inputs and cohort's logits). Prints a line per case, then the report as one
line of JSON; exits 1 when a file does not load or a logit differs by more
than 1e-5.
"""
import json, os, sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from compare_logits import read_safetensors
from models import build

TOLERANCE = 1e-5


def check(directory, label):
    with open(os.path.join(directory, label + ".json")) as f:
        case = json.load(f)
    model = build(case["model"], num_classes=case["classes"],
                  sample_shape=case["sample_shape"], **case["options"])
    state = {k: torch.from_numpy(v)
             for k, v in read_safetensors(os.path.join(directory, label + ".model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    model.eval()
    io = read_safetensors(os.path.join(directory, label + ".io.safetensors"))
    x = torch.from_numpy(io["inputs"])
    if case.get("tokens"):
        x = x.long()  # token ids, held by cohort as exact float32 integers
    with torch.no_grad():
        logits = model(x).numpy()
    difference = float(np.abs(logits - io["logits"]).max())
    return {
        "case": label,
        "model": case["model"],
        "options": case["options"],
        "tensors": len(state),
        "parameters": int(sum(t.numel() for t in model.state_dict().values()
                              if t.dtype.is_floating_point)),
        "max_abs_logit_difference": difference,
        "largest_logit": float(np.abs(io["logits"]).max()),
    }


def main():
    directory = sys.argv[1]
    labels = sorted(f[:-len(".json")] for f in os.listdir(directory) if f.endswith(".json"))
    report, failed = [], False
    for label in labels:
        entry = check(directory, label)
        report.append(entry)
        ok = entry["max_abs_logit_difference"] <= TOLERANCE
        failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label} {entry['options']}: strict load of "
              f"{entry['tensors']} tensors, {entry['parameters']} floats; max |torch - cohort| "
              f"{entry['max_abs_logit_difference']:.2e} (largest logit {entry['largest_logit']:.2f})")
    print(f"torch {torch.__version__}")
    print(json.dumps(report))
    sys.exit(1 if failed or not report else 0)


if __name__ == "__main__":
    main()
