#!/usr/bin/env python3
"""Writes the small file data sets of `data.datasource = "CSV" | "NPZ" | "Safetensors"`.

Under tests/fixtures/tabular/, one data set in three formats: 3 classes, 4
features, 300 training and 60 test samples, each training sample one of 6
clients. Each class is a Gaussian blob (std 0.6) around its own centre, so a
small MLP separates them well above chance (1/3) in a few rounds.
  train.csv, test.csv   header `f0,f1,f2,f3,label,client`, features with 2
                        decimals (exact as float32 both ways)
  tabular.npz           numpy.savez_compressed: x [300, 2, 2] float32 (the 4
                        features as a 2x2 sample, to show any shape), y [300]
                        int64, x_test [60, 2, 2], y_test [60], client_id [300]
                        int32
  tabular.safetensors   safetensors.numpy.save_file: inputs [300, 4] float16,
                        labels [300] int64, test_inputs [60, 4] float16,
                        test_labels [60] int64, client_id [300] int64

The three hold the same samples in the same order (float16 rounds the
features of the safetensors file).
Usage: python3 scripts/make_tabular_fixtures.py   (deterministic: same bytes every run)
"""
import os

import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tabular")
RNG = np.random.RandomState(20261202)
CENTRES = np.array([[2.0, 0.0, -1.0, 1.0], [-1.0, 2.0, 1.0, -1.0], [0.0, -2.0, 1.5, 2.0]])


def blobs(count):
    labels = RNG.randint(3, size=count)
    features = CENTRES[labels] + RNG.normal(0.0, 0.6, size=(count, 4))
    return np.round(features, 2).astype(np.float32), labels.astype(np.int64)


def write_csv(path, features, labels, clients):
    with open(path, "w", newline="\n") as f:
        f.write("f0,f1,f2,f3,label,client\n")
        for row, label, client in zip(features, labels, clients):
            cells = ["%.2f" % v for v in row] + [str(int(label)), str(int(client))]
            f.write(",".join(cells) + "\n")


def main():
    os.makedirs(ROOT, exist_ok=True)
    x, y = blobs(300)
    x_test, y_test = blobs(60)
    clients = (np.arange(300) % 6).astype(np.int32)
    RNG.shuffle(clients)
    write_csv(os.path.join(ROOT, "train.csv"), x, y, clients)
    # A test file needs the training file's header; its client ids are not read.
    write_csv(os.path.join(ROOT, "test.csv"), x_test, y_test, np.zeros(60, dtype=np.int32))
    np.savez_compressed(
        os.path.join(ROOT, "tabular.npz"),
        x=x.reshape(300, 2, 2),
        y=y,
        x_test=x_test.reshape(60, 2, 2),
        y_test=y_test,
        client_id=clients,
    )
    save_file(
        {
            "inputs": x.astype(np.float16),
            "labels": y,
            "test_inputs": x_test.astype(np.float16),
            "test_labels": y_test,
            "client_id": clients.astype(np.int64),
        },
        os.path.join(ROOT, "tabular.safetensors"),
    )


if __name__ == "__main__":
    main()
