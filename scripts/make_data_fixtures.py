#!/usr/bin/env python3
"""Writes small data-set fixtures in the real file formats, and what they hold.

Under tests/fixtures/data/, each in its data set's own folder and file names:
  cifar-10-batches-bin/  data_batch_1.bin .. data_batch_5.bin, test_batch.bin
                         (records of 1 label byte + 3,072 pixel bytes)
  cifar-100-binary/      train.bin, test.bin (coarse byte, fine byte, pixels)
  emnist/                emnist-balanced-{train,test}-{images-idx3,labels-idx1}-ubyte.gz
                         (IDX, each image stored transposed as EMNIST's are)
  femnist/{train,test}/  LEAF JSON: users, num_samples, user_data {x: 784 floats, y}
  shakespeare/{train,test}/  LEAF JSON: x an 80-character string, y the next one
and expected.json: labels, users and sampled values of each split, so the
tests hold the loaders to what was written here, not to what they read.

The pixels and texts are random (seeded): tests of the readers, not data to learn.
Usage: python3 scripts/make_data_fixtures.py   (deterministic: same bytes every run)
"""
import gzip
import json
import os
import struct

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "data")
RNG = np.random.RandomState(20261201)
# LEAF's ALL_LETTERS (models/utils/language_utils.py).
LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
assert len(LETTERS) == 80


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def checks(pixels, count):
    """`count` (sample, flat index, value) triples of a (samples, values) array."""
    out = []
    for _ in range(count):
        s = int(RNG.randint(pixels.shape[0]))
        i = int(RNG.randint(pixels.shape[1]))
        out.append([s, i, pixels[s, i].item()])
    return out


def cifar(folder, label_bytes, classes, train_counts, test_count, train_names, test_name):
    expected = {}
    for split, names, counts in (
        ("train", train_names, train_counts),
        ("test", [test_name], [test_count]),
    ):
        labels, pixels = [], []
        for name, count in zip(names, counts):
            fine = RNG.randint(classes, size=count).astype(np.uint8)
            image = RNG.randint(256, size=(count, 3072)).astype(np.uint8)
            head = fine[:, None] if label_bytes == 1 else np.stack([fine // 5, fine], axis=1)
            write(os.path.join(ROOT, folder, name), np.hstack([head, image]).tobytes())
            labels += fine.tolist()
            pixels.append(image)
        expected[split] = {"labels": labels, "checks": checks(np.vstack(pixels), 12)}
    return expected


def idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # mtime=0 keeps the bytes reproducible.
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write(header + array.astype(np.uint8).tobytes())


def emnist(counts):
    expected = {}
    for split, count in counts.items():
        upright = np.zeros((count, 28, 28), dtype=np.uint8)
        # An L: a bar down the left, a foot along the bottom, so a transposed
        # image (a bar along the top) is told apart.
        upright[:, 4:24, 6:9] = 210
        upright[:, 21:24, 6:20] = 170
        upright += RNG.randint(40, size=upright.shape).astype(np.uint8)
        labels = RNG.randint(47, size=count).astype(np.uint8)
        prefix = os.path.join(ROOT, "emnist", f"emnist-balanced-{split}")
        idx(prefix + "-images-idx3-ubyte.gz", np.transpose(upright, (0, 2, 1)))
        idx(prefix + "-labels-idx1-ubyte.gz", labels)
        expected[split] = {
            "labels": labels.tolist(),
            "checks": checks(upright.reshape(count, 784), 12),
        }
    return expected


def leaf_file(path, user_data):
    body = {
        "users": list(user_data),
        "num_samples": [len(d["y"]) for d in user_data.values()],
        "user_data": user_data,
    }
    write(path, json.dumps(body).encode())


def femnist():
    expected = {}
    layout = {
        "train": {"all_data_0_niid_0_keep_0_train_9.json": {"f0001_41": 3, "f0002_07": 2},
                  "all_data_1_niid_0_keep_0_train_9.json": {"f0100_33": 2}},
        "test": {"all_data_0_niid_0_keep_0_test_9.json": {"f0001_41": 1, "f0002_07": 1, "f0100_33": 1}},
    }
    for split, files in layout.items():
        labels, users, values = [], [], []
        for name in sorted(files):
            data = {}
            for user, n in files[name].items():
                # LEAF's values: pixels / 255, paper near 1.0; two decimals keep the file small.
                x = np.round(RNG.uniform(0.0, 1.0, size=(n, 784)), 2)
                y = RNG.randint(62, size=n)
                data[user] = {"x": x.tolist(), "y": y.tolist()}
                labels += y.tolist()
                users += [user] * n
                values.append(x)
            leaf_file(os.path.join(ROOT, "femnist", split, name), data)
        expected[split] = {"labels": labels, "users": users, "checks": checks(np.vstack(values), 12)}
    return expected


def shakespeare():
    expected = {}
    layout = {
        "train": {"all_data_niid_0_keep_0_train_9.json": {"THE_TEMPEST_MIRANDA": 3, "HAMLET_HAMLET": 2}},
        "test": {"all_data_niid_0_keep_0_test_9.json": {"THE_TEMPEST_MIRANDA": 1, "HAMLET_HAMLET": 1}},
    }
    for split, files in layout.items():
        labels, users, first = [], [], None
        for name, roles in files.items():
            data = {}
            for role, n in roles.items():
                text = "".join(LETTERS[i] for i in RNG.randint(80, size=n + 80))
                xs = [text[i : i + 80] for i in range(n)]
                ys = [text[i + 80] for i in range(n)]
                data[role] = {"x": xs, "y": ys}
                labels += [LETTERS.find(c) for c in ys]
                users += [role] * n
                first = first or [LETTERS.find(c) for c in xs[0]]
            leaf_file(os.path.join(ROOT, "shakespeare", split, name), data)
        expected[split] = {"labels": labels, "users": users, "first_tokens": first}
    return expected


expected = {
    "CIFAR10": cifar(
        "cifar-10-batches-bin", 1, 10, [3, 3, 3, 3, 3], 4,
        [f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin",
    ),
    "CIFAR100": cifar("cifar-100-binary", 2, 100, [6], 3, ["train.bin"], "test.bin"),
    "EMNIST": emnist({"train": 20, "test": 10}),
    "FEMNIST": femnist(),
    "Shakespeare": shakespeare(),
}
write(os.path.join(ROOT, "expected.json"), (json.dumps(expected, indent=1) + "\n").encode())
