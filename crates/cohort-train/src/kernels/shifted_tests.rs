//! The shifted-copies convolution against im2col's on ragged shapes: maps
//! of 1 × 1 to 9 × 7, kernels of other sides than 3, padding on one side
//! only or wider than the kernel's half (outputs wider than the input, so
//! no copy is the layout itself), offsets that read no input row at all,
//! and batches of several groups.

use super::direct_tests::{Path, Results, assert_close, run_on};
use super::im2col::Geometry;
use super::shifted::{applies, applies_to_weight_gradient};

fn geometry(
    batch: usize,
    (c_in, c_out): (usize, usize),
    size: [usize; 2],
    kernel: [usize; 2],
    pad: [(usize, usize); 2],
) -> Geometry {
    Geometry {
        batch,
        c_in,
        height: size[0],
        width: size[1],
        c_out,
        kernel,
        stride: [1, 1],
        pad,
    }
}

/// `g` on seeded inputs, through this path (`shifted`) or im2col.
fn run(g: &Geometry, seed: u64, shifted: bool) -> Results {
    run_on(
        g,
        seed,
        if shifted {
            Path::Shifted
        } else {
            Path::Columns
        },
    )
}

fn cases() -> Vec<Geometry> {
    let same = [(1, 1), (1, 1)];
    vec![
        // VGG's last maps, shortened: 2 × 2 and 4 × 4, padding 1.
        geometry(3, (32, 40), [2, 2], [3, 3], same),
        geometry(2, (48, 16), [4, 4], [3, 3], same),
        // 8 × 8: 32 images a group (2,048 columns), so 35 make two groups.
        geometry(35, (32, 8), [8, 8], [3, 3], same),
        // A 1 × 1 map: only the centre offset reads the input.
        geometry(2, (32, 9), [1, 1], [3, 3], same),
        // Non-square map and kernel, padding on one side of each axis.
        geometry(2, (33, 7), [9, 7], [3, 5], [(0, 2), (2, 1)]),
        // No padding (the output narrower than the input).
        geometry(2, (32, 5), [6, 7], [3, 3], [(0, 0), (0, 0)]),
        // Padding wider than the kernel's half: outputs wider than the
        // input, the first and last rows read no input at all.
        geometry(2, (32, 6), [3, 3], [2, 2], [(2, 2), (2, 2)]),
        // An even kernel, cnn-like 5 × 5 with padding 2.
        geometry(2, (32, 8), [5, 5], [5, 5], [(2, 2), (2, 2)]),
    ]
}

/// Each value within `1e-5` of the largest magnitude of im2col's tensor
/// (`direct_tests`' tolerance): the same sums in another order.
#[test]
fn the_shifted_copies_give_im2cols_results() {
    for (i, g) in cases().iter().enumerate() {
        assert!(applies(g), "{g:?}");
        assert_close(&run(g, i as u64, true), &run(g, i as u64, false), g);
    }
}

/// The same inputs give the same bits, call after call (the buffers reused
/// between calls carry nothing over).
#[test]
fn the_shifted_copies_repeat_bit_for_bit() {
    let g = geometry(3, (32, 40), [4, 4], [3, 3], [(1, 1), (1, 1)]);
    let bits = |r: Results| -> Vec<Vec<u32>> {
        r.iter()
            .map(|v| v.iter().map(|f| f.to_bits()).collect())
            .collect()
    };
    let first = bits(run(&g, 7, true));
    let other = run(
        &geometry(2, (64, 8), [8, 8], [5, 5], [(2, 2), (2, 2)]),
        8,
        true,
    );
    assert!(other.iter().all(|v| v.iter().all(|f| f.is_finite())));
    assert_eq!(bits(run(&g, 7, true)), first);
}

#[test]
fn applies_to_stride_one_convolutions_of_enough_channels() {
    let small = geometry(1, (512, 512), [2, 2], [3, 3], [(1, 1), (1, 1)]);
    assert!(applies(&small) && applies_to_weight_gradient(&small));
    let larger = Geometry {
        height: 8,
        width: 8,
        ..small
    };
    assert!(applies(&larger) && !applies_to_weight_gradient(&larger));
    // cnn's second layer: a 5 × 5 kernel's weight gradient on any map.
    let five = geometry(1, (32, 64), [14, 14], [5, 5], [(2, 2), (2, 2)]);
    assert!(applies(&five) && applies_to_weight_gradient(&five));
    let strided = Geometry {
        stride: [2, 2],
        ..small
    };
    let pointwise = geometry(1, (512, 512), [2, 2], [1, 1], [(0, 0), (0, 0)]);
    let few_channels = geometry(1, (3, 64), [32, 32], [3, 3], [(1, 1), (1, 1)]);
    for g in [strided, pointwise, few_channels] {
        assert!(!applies(&g) && !applies_to_weight_gradient(&g), "{g:?}");
    }
}
