"""LeNet-5 local training in numpy: forward with a cache, backward, SGD.

The parameters are a dict of float32 arrays in PyTorch's layout, the one
cohort sends and expects (docs/ARCHITECTURE.md, "Tensor layout"); lenet5.py
has the shapes (``lenet5.SHAPES``) and checks them (``lenet5.check``):

    conv1.weight [6, 1, 5, 5]    conv1.bias [6]     (padding 2)
    conv2.weight [16, 6, 5, 5]   conv2.bias [16]
    conv3.weight [120, 16, 5, 5] conv3.bias [120]
    fc4.weight   [84, 120]       fc4.bias   [84]    (linear: [out, in])
    fc5.weight   [10, 84]        fc5.bias   [10]

The network is lenet5.py's: conv1 -> relu -> 2x2 max-pool -> conv2 -> relu
-> 2x2 max-pool -> conv3 -> relu -> flatten -> fc4 -> relu -> fc5 (logits).
Training needs what lenet5.forward discards (each layer's input patches,
ReLU masks and max-pool choices), so :func:`forward` here computes the same
logits while keeping them; evaluation uses lenet5.forward itself. Convolutions
are im2col matrix products (``lenet5.im2col``), so a batch costs a handful of
BLAS calls.

Run `python3 train.py --self-test` to check the backward pass against finite
differences and this forward pass against lenet5.forward.
"""

import numpy as np

import lenet5

CONVS = ("conv1", "conv2", "conv3")
LINEARS = ("fc4", "fc5")


def col2im(columns, x_shape, k, pad):
    """The adjoint of im2col: sums each column entry back into its pixel."""
    n, c, h, w = x_shape
    hp, wp = h + 2 * pad, w + 2 * pad
    ho, wo = hp - k + 1, wp - k + 1
    patches = columns.reshape(n, ho, wo, c, k, k)
    dx = np.zeros((n, c, hp, wp), dtype=columns.dtype)
    for i in range(k):
        for j in range(k):
            dx[:, :, i:i + ho, j:j + wo] += patches[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return dx[:, :, pad:pad + h, pad:pad + w]


def conv_forward(x, weight, bias, pad):
    out_channels, _, k, _ = weight.shape
    columns, (ho, wo) = lenet5.im2col(x, k, k, pad)
    y = columns @ weight.reshape(out_channels, -1).T + bias
    y = y.reshape(x.shape[0], ho, wo, out_channels).transpose(0, 3, 1, 2)
    return y, (x.shape, columns)


def conv_backward(dy, weight, cache, pad):
    x_shape, columns = cache
    out_channels, _, k, _ = weight.shape
    dy_rows = dy.transpose(0, 2, 3, 1).reshape(-1, out_channels)
    dweight = (dy_rows.T @ columns).reshape(weight.shape)
    dbias = dy_rows.sum(axis=0)
    dx = col2im(dy_rows @ weight.reshape(out_channels, -1), x_shape, k, pad)
    return dx, dweight, dbias


def pool_forward(x):
    """2x2 max-pool, stride 2; the gradient goes to the first maximum of each
    window, as PyTorch's does."""
    n, c, h, w = x.shape
    windows = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5)
    windows = windows.reshape(n, c, h // 2, w // 2, 4)
    choice = windows.argmax(axis=-1)
    y = np.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    return y, (x.shape, choice)


def pool_backward(dy, cache):
    (n, c, h, w), choice = cache
    windows = np.zeros(choice.shape + (4,), dtype=dy.dtype)
    np.put_along_axis(windows, choice[..., None], dy[..., None], axis=-1)
    windows = windows.reshape(n, c, h // 2, w // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
    return windows.reshape(n, c, h, w)


def forward(params, images):
    """Logits [N, classes] of images [N, 1, 28, 28], with what backward needs."""
    caches = {}
    x = images
    for name in CONVS:
        x, caches[name] = conv_forward(x, params[name + ".weight"], params[name + ".bias"], lenet5.PADDING[name])
        caches[name + ".relu"] = x > 0
        x = np.maximum(x, 0)
        if name != "conv3":
            x, caches[name + ".pool"] = pool_forward(x)
    x = x.reshape(x.shape[0], -1)
    for name in LINEARS:
        caches[name] = x
        x = x @ params[name + ".weight"].T + params[name + ".bias"]
        if name != LINEARS[-1]:
            caches[name + ".relu"] = x > 0
            x = np.maximum(x, 0)
    return x, caches


def cross_entropy(logits, labels):
    """Mean cross-entropy and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = -log_probs[rows, labels].mean()
    dlogits = np.exp(log_probs)
    dlogits[rows, labels] -= 1
    return float(loss), (dlogits / len(labels)).astype(logits.dtype)


def backward(params, caches, dlogits):
    grads = {}
    dx = dlogits
    for name in reversed(LINEARS):
        if name != LINEARS[-1]:
            dx = dx * caches[name + ".relu"]
        grads[name + ".weight"] = dx.T @ caches[name]
        grads[name + ".bias"] = dx.sum(axis=0)
        dx = dx @ params[name + ".weight"]
    dx = dx.reshape(dx.shape[0], -1, 1, 1)
    for name in reversed(CONVS):
        if name != "conv3":
            dx = pool_backward(dx, caches[name + ".pool"])
        dx = dx * caches[name + ".relu"]
        dx, grads[name + ".weight"], grads[name + ".bias"] = conv_backward(
            dx, params[name + ".weight"], caches[name], lenet5.PADDING[name])
    return grads


class Sgd:
    """PyTorch's SGD: g += weight_decay * w; buf = momentum * buf + g; w -= lr * buf."""

    def __init__(self, learning_rate, momentum=0.0, weight_decay=0.0):
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.buffers = {}

    def step(self, params, grads):
        for name, grad in grads.items():
            if self.weight_decay:
                grad = grad + self.weight_decay * params[name]
            if self.momentum:
                buffer = self.buffers.get(name)
                buffer = grad if buffer is None else self.momentum * buffer + grad
                self.buffers[name] = buffer
                grad = buffer
            params[name] = (params[name] - self.learning_rate * grad).astype(np.float32)


def train(params, images, labels, epochs, batch_size, optimizer, rng):
    """Trains in place for `epochs` passes of ceil(N / batch_size) steps each,
    shuffled every epoch; returns (mean loss, steps)."""
    losses, steps = [], 0
    for _ in range(epochs):
        order = rng.permutation(len(labels))
        for start in range(0, len(labels), batch_size):
            batch = order[start:start + batch_size]
            logits, caches = forward(params, images[batch])
            loss, dlogits = cross_entropy(logits, labels[batch])
            optimizer.step(params, backward(params, caches, dlogits))
            losses.append(loss)
            steps += 1
    return float(np.mean(losses)), steps


def count_correct(params, images, labels, batch_size=256):
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = lenet5.forward(params, images[start:start + batch_size])
        correct += int((logits.argmax(axis=1) == labels[start:start + batch_size]).sum())
    return correct


def random_params(rng):
    return {name: (0.1 * rng.standard_normal(shape)).astype(np.float64)
            for name, shape in lenet5.SHAPES.items()}


def self_test():
    """Finite differences in float64 against the backward pass, and this
    forward pass against lenet5.forward."""
    rng = np.random.default_rng(0)
    params = random_params(rng)
    images = rng.standard_normal((3, 1, 28, 28))
    labels = np.array([1, 7, 3])
    logits, caches = forward(params, images)
    reference = lenet5.forward(params, images)
    if not np.allclose(logits, reference, rtol=1e-12, atol=1e-12):
        raise SystemExit(f"train.forward and lenet5.forward disagree by {np.abs(logits - reference).max()}")
    _, dlogits = cross_entropy(logits, labels)
    grads = backward(params, caches, dlogits)
    eps = 1e-6
    for name, value in params.items():
        for index in [tuple(rng.integers(0, s) for s in value.shape) for _ in range(3)]:
            saved = value[index]
            value[index] = saved + eps
            up, _ = cross_entropy(forward(params, images)[0], labels)
            value[index] = saved - eps
            down, _ = cross_entropy(forward(params, images)[0], labels)
            value[index] = saved
            numeric = (up - down) / (2 * eps)
            if not np.isclose(numeric, grads[name][index], rtol=1e-4, atol=1e-7):
                raise SystemExit(f"{name}{index}: backward {grads[name][index]}, finite differences {numeric}")
    print("backward matches finite differences; forward matches lenet5.forward")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--self-test"]:
        self_test()
    else:
        raise SystemExit("usage: python3 train.py --self-test")
