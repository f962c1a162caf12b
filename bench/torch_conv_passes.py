"""PyTorch's counterpart of `cargo bench -p cohort-train --bench conv_passes`:
each pass of a 3 × 3, padding-1 convolution at batch 32 on one thread (the
forward pass, the input gradient alone and the weight gradient alone,
through `torch.ops.aten.convolution_backward` with its output mask), best
of --reps after a warm-up, in milliseconds, with GFLOP/s of the three
counting every offset of every position as conv_passes does.

    python3 bench/torch_conv_passes.py [--reps 7]
"""

import argparse
import time

import torch

# The layers of benches/conv_passes.rs: vgg_11's, then resnet_20's.
LAYERS = [
    (3, 64, 32),
    (64, 128, 16),
    (128, 256, 8),
    (256, 256, 8),
    (256, 512, 4),
    (512, 512, 4),
    (512, 512, 2),
    (16, 16, 32),
    (32, 32, 16),
    (64, 64, 8),
]


def best(run, reps):
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# torch {torch.__version__}, batch 32, 3 × 3, padding 1, one thread; "
          f"ms: forward / input gradient / weight gradient = sum (GFLOP/s); best of {args.reps}")
    for c_in, c_out, side in LAYERS:
        x = torch.randn(32, c_in, side, side)
        w = torch.randn(c_out, c_in, 3, 3) * 0.01
        grad = torch.randn(32, c_out, side, side)

        def backward(mask):
            return torch.ops.aten.convolution_backward(
                grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask)

        forward = best(lambda: torch.nn.functional.conv2d(x, w, padding=1), args.reps)
        d_input = best(lambda: backward([True, False, False]), args.reps)
        d_weight = best(lambda: backward([False, True, False]), args.reps)
        total = forward + d_input + d_weight
        flop = 3 * 2 * 32 * c_in * c_out * 9 * side * side
        print(f"{c_in:>4} → {c_out:<4} {side:>2}×{side:<2}  torch: {forward:.2f} / {d_input:.2f} / "
              f"{d_weight:.2f} = {total:.2f} ({flop / total / 1e6:.0f})")


if __name__ == "__main__":
    main()
