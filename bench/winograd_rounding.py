"""How far Winograd's F(2x2, 3x3) and F(2x2, 5x5) round in float32, against a
direct sum, on one convolution's forward pass and weight gradient.

Each is computed in float32 and in float64 with NumPy (the same matrices as
crates/cohort-train/src/kernels/winograd/), and the largest distance from the
float64 direct result is printed, with the largest value for scale. This is
the measurement behind the routes' choice to keep 5x5 weight gradients on the
direct kernels.

    python3 bench/winograd_rounding.py [--images 5] [--channels 8] [--side 28]
"""

import argparse

import numpy as np

# F(2x2, 3x3) and F(2x2, 5x5): B^T, G, A^T (Toom-Cook at 0, +-1 (+-2), infinity).
MATRICES = {
    3: (
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    5: (
        [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ],
        [
            [1 / 4, 0, 0, 0, 0],
            [-1 / 6] * 5,
            [-1 / 6, 1 / 6, -1 / 6, 1 / 6, -1 / 6],
            [1 / 24, 1 / 12, 1 / 6, 1 / 3, 2 / 3],
            [1 / 24, -1 / 12, 1 / 6, -1 / 3, 2 / 3],
            [0, 0, 0, 0, 1],
        ],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 1]],
    ),
}


def direct(x, w, dy, r, dtype):
    """Forward pass and weight gradient of a stride-1 'same' convolution."""
    pad = r // 2
    side = x.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))).astype(dtype)
    w, dy = w.astype(dtype), dy.astype(dtype)
    y = np.zeros((x.shape[0], w.shape[0], side, side), dtype)
    dw = np.zeros(w.shape, dtype)
    for ky in range(r):
        for kx in range(r):
            window = xp[:, :, ky : ky + side, kx : kx + side]
            y += np.einsum("oc,bchw->bohw", w[:, :, ky, kx], window)
            dw[:, :, ky, kx] = np.einsum("bohw,bchw->oc", dy, window)
    return y, dw


def winograd(x, w, dy, r, dtype):
    """The same through F(2x2, r x r): tiles' patches, products, transforms."""
    bt, g, at = (np.array(m, dtype) for m in MATRICES[r])
    n, pad, side = r + 1, r // 2, x.shape[2]
    tiles = side // 2
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))).astype(dtype)
    starts = np.arange(tiles) * 2
    rows = starts[:, None, None, None] + np.arange(n)[None, None, :, None]
    cols = starts[None, :, None, None] + np.arange(n)[None, None, None, :]
    patches = xp[:, :, rows, cols]  # [B, C, ty, tx, n, n]
    v = np.einsum("ij,bctujk,lk->bctuil", bt, patches, bt)
    u = np.einsum("ij,ocjk,lk->ocil", g, w.astype(dtype), g)
    m = np.einsum("ocij,bctuij->botuij", u, v)
    y = np.einsum("ij,botujk,lk->botuil", at, m, at)
    y = y.transpose(0, 1, 2, 4, 3, 5).reshape(x.shape[0], w.shape[0], side, side)
    d = dy.astype(dtype).reshape(dy.shape[0], dy.shape[1], tiles, 2, tiles, 2)
    dm = np.einsum("ij,botiuk,kl->botujl", at, d, at)
    du = np.einsum("botuij,bctuij->ocij", dm, v)
    return y, np.einsum("ji,ocjk,kl->ocil", g, du, g)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=5)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--side", type=int, default=28)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    b, c, side = args.images, args.channels, args.side
    print(f"# {b} images, {c} -> {c} channels, {side} x {side}; inputs uniform in [-1, 1)")
    print("# kernel pass largest-value direct-float32 winograd-float32 (distance from float64)")
    for r in (3, 5):
        x = rng.uniform(-1, 1, (b, c, side, side))
        w = rng.uniform(-1, 1, (c, c, r, r))
        dy = rng.uniform(-1, 1, (b, c, side, side))
        exact = direct(x, w, dy, r, np.float64)
        check = winograd(x, w, dy, r, np.float64)
        for e, k in zip(exact, check):
            assert np.abs(e - k).max() < 1e-9 * np.abs(e).max(), "the matrices"
        ours = direct(x, w, dy, r, np.float32), winograd(x, w, dy, r, np.float32)
        for i, name in enumerate(("forward", "weight-gradient")):
            errors = [np.abs(o[i] - exact[i]).max() for o in ours]
            print(f"{r}x{r} {name} {np.abs(exact[i]).max():.3g} {errors[0]:.3g} {errors[1]:.3g}")


if __name__ == "__main__":
    main()
