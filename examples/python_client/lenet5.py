"""LeNet-5 in numpy, written from PyTorch's definitions, on cohort's model files.

cohort stores models in PyTorch's layout (docs/ARCHITECTURE.md, "Tensor
layout"), so this forward pass reads `model.safetensors` as PyTorch's
`LeNet5` of examples/pytorch/models.py would:

* ``nn.Conv2d``: weight ``[out, in, kh, kw]``, bias ``[out]``, cross-correlation
  with zero padding;
* ``nn.MaxPool2d(2, 2)``: the largest of each 2x2 window, stride 2;
* ``nn.Linear``: weight ``[out, in]``, ``y = x W^T + b``.

Only numpy is needed (and safetensors to read a file). Images are cohort's:
``[N, 1, 28, 28]`` float32, normalized with MNIST's statistics
(:func:`normalize`); :func:`read_idx` reads the IDX files cohort's data folders
hold. train.py (the Python client's local training) builds on this module:
its forward pass keeps what backward needs and is checked against
:func:`forward`.

Usage as a script: ``python3 lenet5.py MODEL IMAGES_IDX_GZ LABELS_IDX_GZ [N]``
prints the accuracy on the first N test images (all by default).
"""

import gzip
import struct
import sys

import numpy as np

#: The tensors of cohort's ``lenet5`` model file: PyTorch's ``state_dict`` of
#: ``LeNet5(num_classes=10)``.
SHAPES = {
    "conv1.weight": (6, 1, 5, 5),
    "conv1.bias": (6,),
    "conv2.weight": (16, 6, 5, 5),
    "conv2.bias": (16,),
    "conv3.weight": (120, 16, 5, 5),
    "conv3.bias": (120,),
    "fc4.weight": (84, 120),
    "fc4.bias": (84,),
    "fc5.weight": (10, 84),
    "fc5.bias": (10,),
}

#: Zero padding of each convolution of cohort's ``lenet5`` (PyTorch's ``padding``).
PADDING = {"conv1": 2, "conv2": 0, "conv3": 0}

#: MNIST's mean and standard deviation, which cohort (like Plato) uses for MNIST
#: and Fashion-MNIST alike.
MEAN, STD = 0.1307, 0.3081


def im2col(x, kh, kw, padding=0):
    """The patches of a stride-1 convolution: ``x`` ``[N, C, H, W]`` becomes
    rows ``[N * H' * W', C * kh * kw]``, each ordered channel-major as
    PyTorch's ``weight.reshape(out, -1)`` orders a kernel; also ``(H', W')``."""
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    # [N, C, H', W', kh, kw] as a view, then rows of C*kh*kw patch values.
    windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))
    n, c, h, w = windows.shape[:4]
    return windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * w, c * kh * kw), (h, w)


def conv2d(x, weight, bias, padding=0):
    """PyTorch's ``F.conv2d`` (stride 1): ``x`` is ``[N, C, H, W]``, ``weight``
    ``[out, C, kh, kw]``; im2col, then one matrix product."""
    out_channels, _, kh, kw = weight.shape
    patches, (h, w) = im2col(x, kh, kw, padding)
    y = patches @ weight.reshape(out_channels, -1).T + bias
    return y.reshape(len(x), h, w, out_channels).transpose(0, 3, 1, 2)


def max_pool2d(x):
    """PyTorch's ``F.max_pool2d(x, 2, 2)`` on ``[N, C, H, W]`` (odd edges dropped)."""
    n, c, h, w = x.shape
    x = x[:, :, : h - h % 2, : w - w % 2]
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def linear(x, weight, bias):
    """PyTorch's ``F.linear``: ``weight`` is ``[out, in]``."""
    return x @ weight.T + bias


def relu(x):
    return np.maximum(x, 0)


def check(params):
    """Raises ValueError naming the first tensor that is missing, unexpected or
    of the wrong shape for LeNet-5 (any number of classes)."""
    extra = sorted(set(params) - set(SHAPES))
    if extra:
        raise ValueError(f"tensor `{extra[0]}` is not part of LeNet-5")
    classes = params["fc5.bias"].shape[0] if "fc5.bias" in params else 10
    for name, shape in SHAPES.items():
        if name.startswith("fc5."):
            shape = (classes,) + shape[1:]
        if name not in params:
            raise ValueError(f"LeNet-5 needs tensor `{name}` {shape}; the model has none")
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"tensor `{name}` has shape {tuple(params[name].shape)}, LeNet-5 needs {shape}"
                " (linear weights are [out, in], PyTorch's layout)"
            )


def forward(params, images):
    """Logits ``[N, classes]`` of LeNet-5 with ``params`` (name -> array, as
    ``safetensors.numpy.load_file`` returns them) on ``images`` ``[N, 1, 28, 28]``."""
    check(params)
    p = params
    x = max_pool2d(relu(conv2d(images, p["conv1.weight"], p["conv1.bias"], PADDING["conv1"])))
    x = max_pool2d(relu(conv2d(x, p["conv2.weight"], p["conv2.bias"], PADDING["conv2"])))
    x = relu(conv2d(x, p["conv3.weight"], p["conv3.bias"], PADDING["conv3"])).reshape(len(images), -1)
    x = relu(linear(x, p["fc4.weight"], p["fc4.bias"]))
    return linear(x, p["fc5.weight"], p["fc5.bias"])


def read_idx(path):
    """An IDX file (gzip), as MNIST and Fashion-MNIST ship: a uint8 array."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    count = int(np.prod(dims))
    if body.size < count:
        raise ValueError(f"{path} holds {body.size} values, its header says {count}")
    return body[:count].reshape(dims)


def normalize(images):
    """Images as cohort feeds them to a model: ``[N, 1, 28, 28]`` float32,
    ``(p / 255 - MEAN) / STD``. ``images`` are ``[N, 28, 28]`` or
    ``[N, 1, 28, 28]``: uint8 pixel values (IDX files), computed as cohort
    does (``p * (1 / (255 STD)) - MEAN / STD`` in float32), or float
    intensities in [0, 1] (what ``cohort client --data`` also accepts)."""
    if images.dtype == np.uint8:
        scale = np.float32(1.0) / (np.float32(255.0) * np.float32(STD))
    else:
        scale = np.float32(1.0) / np.float32(STD)
    shift = np.float32(MEAN) / np.float32(STD)
    x = images.astype(np.float32) * scale - shift
    return x.reshape(len(images), 1, *images.shape[-2:])


def main(argv):
    from safetensors.numpy import load_file

    if len(argv) not in (4, 5):
        sys.exit(f"usage: {argv[0]} MODEL IMAGES_IDX_GZ LABELS_IDX_GZ [N]")
    params = load_file(argv[1])
    images, labels = read_idx(argv[2]), read_idx(argv[3])
    n = int(argv[4]) if len(argv) == 5 else len(labels)
    logits = forward(params, normalize(images[:n]))
    correct = int((logits.argmax(axis=1) == labels[:n]).sum())
    print(f"{correct} of {n} correct, accuracy {correct / n:.4f}")


if __name__ == "__main__":
    main(sys.argv)
