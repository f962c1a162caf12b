"""PyTorch loads cohort's model files with strict=True and computes cohort's logits.

    cohort evaluate --config RUN/config.toml --model RUN/model.safetensors --logits LOGITS.safetensors
    python3 examples/pytorch/compare_logits.py MODEL_NAME RUN/model.safetensors LOGITS.safetensors TEST_IMAGES_IDX_GZ

Prints the largest logit difference and how often the predictions agree.
Needs torch and numpy; reads safetensors with its own few lines, so the
`safetensors` package is not needed.
"""
import gzip, json, struct, sys
import numpy as np
import torch
sys.path.insert(0, __import__("os").path.dirname(__file__))
from models import build

DT = {"F32": np.float32, "I64": np.int64, "F16": np.float16}

def read_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        a, b = spec["data_offsets"]
        out[name] = np.frombuffer(raw[base + a:base + b], dtype=DT[spec["dtype"]]).reshape(spec["shape"]).copy()
    return out

def read_idx(path):
    raw = gzip.open(path).read()
    dims = raw[3]
    shape = struct.unpack(">" + "I" * dims, raw[4:4 + 4 * dims])
    return np.frombuffer(raw[4 + 4 * dims:], dtype=np.uint8).reshape(shape)

def main():
    name, model_file, logits_file, images_file = sys.argv[1:5]
    images = read_idx(images_file).astype(np.float32)
    count = read_safetensors(logits_file)["labels"].shape[0]
    x = torch.from_numpy(((images[:count] / 255.0 - 0.1307) / 0.3081)[:, None, :, :].astype(np.float32))
    state = {k: torch.from_numpy(v) for k, v in read_safetensors(model_file).items()}
    model = build(name)
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(x).numpy()
    theirs = read_safetensors(logits_file)
    labels, ours = theirs["labels"], theirs["logits"]
    diff = np.abs(logits - ours).max()
    agree = int((logits.argmax(1) == ours.argmax(1)).sum())
    print(f"torch {torch.__version__}, {name}: load_state_dict(strict=True) ok ({len(state)} tensors); "
          f"max |torch - cohort| logit {diff:.2e}; argmax agrees on {agree}/{len(labels)}; "
          f"correct: torch {int((logits.argmax(1) == labels).sum())}, cohort {int((ours.argmax(1) == labels).sum())}")


if __name__ == "__main__":
    main()
