//! The Winograd convolutions (3 × 3 and 5 × 5) against im2col's on ragged
//! shapes: odd map sides (a last tile half outside the map), 1 × 1 to 32 ×
//! 32 maps, channels that differ in and out, batches of several groups.

use super::direct_tests::{Path, Results, assert_close, run_on};
use super::im2col::Geometry;
use super::winograd::{applies, fastest, fastest_for_weight_gradient};

fn geometry(batch: usize, (c_in, c_out): (usize, usize), size: [usize; 2]) -> Geometry {
    with_kernel(3, batch, (c_in, c_out), size)
}

/// An `r × r` kernel with "same" padding.
fn with_kernel(
    r: usize,
    batch: usize,
    (c_in, c_out): (usize, usize),
    size: [usize; 2],
) -> Geometry {
    Geometry {
        batch,
        c_in,
        height: size[0],
        width: size[1],
        c_out,
        kernel: [r, r],
        stride: [1, 1],
        pad: [(r / 2, r / 2), (r / 2, r / 2)],
    }
}

fn cases() -> Vec<Geometry> {
    vec![
        // resnet_20's stages, shortened batches; 16 channels of 32 × 32 are
        // four images a group, so six make two groups, the second short.
        geometry(6, (16, 16), [32, 32]),
        geometry(3, (32, 32), [16, 16]),
        geometry(5, (64, 64), [8, 8]),
        // VGG's last maps.
        geometry(3, (32, 40), [4, 4]),
        geometry(2, (48, 16), [2, 2]),
        // Odd sides: the last tile's second row and column lie outside.
        geometry(2, (9, 13), [5, 7]),
        geometry(3, (8, 1), [1, 1]),
        geometry(2, (8, 6), [3, 1]),
        geometry(2, (10, 8), [1, 6]),
        // Larger odd and uneven sides: last tiles partly outside the map.
        geometry(2, (9, 12), [9, 11]),
        geometry(2, (16, 8), [10, 8]),
        // More channels out than in, and the reverse.
        geometry(2, (8, 70), [6, 6]),
        geometry(2, (70, 8), [6, 6]),
        // 5 × 5: cnn's and cnn_femnist's second layer (14 × 14); a first
        // layer's 28 × 28 with 8 channels, 36 · 8 · 196 floats an image, so
        // five images make two groups; odd and tiny maps, where most of
        // a patch is padding.
        with_kernel(5, 2, (32, 64), [14, 14]),
        with_kernel(5, 5, (8, 8), [28, 28]),
        with_kernel(5, 2, (9, 13), [7, 5]),
        with_kernel(5, 2, (8, 3), [1, 1]),
        with_kernel(5, 2, (8, 5), [2, 3]),
    ]
}

fn run(g: &Geometry, seed: u64, winograd: bool) -> Results {
    let path = if winograd {
        Path::Winograd
    } else {
        Path::Columns
    };
    run_on(g, seed, path)
}

#[test]
fn gives_im2cols_results() {
    for (i, g) in cases().iter().enumerate() {
        assert!(applies(g), "{g:?}");
        let mut ours = run(g, i as u64, true);
        let theirs = run(g, i as u64, false);
        if g.kernel == [5, 5] {
            // F(2 × 2, 5 × 5)'s weight gradient rounds more than a direct
            // sum (why the routes keep it elsewhere): within 1e-4 of the
            // largest value here (1.2e-5 measured on 28 × 28), and the
            // other results within the usual bound.
            let scale = theirs[2].iter().fold(1.0f32, |m, v| m.max(v.abs()));
            for (x, y) in ours[2].iter().zip(&theirs[2]) {
                assert!(
                    (x - y).abs() <= 1e-4 * scale,
                    "weight gradient of {g:?}: {x} against {y}"
                );
            }
            ours[2].clone_from(&theirs[2]);
        }
        assert_close(&ours, &theirs, g);
    }
}

#[test]
fn gives_the_same_bits_every_run() {
    for g in [
        geometry(6, (16, 24), [10, 10]),
        with_kernel(5, 3, (16, 24), [9, 9]),
    ] {
        assert_eq!(run(&g, 7, true), run(&g, 7, true), "{g:?}");
    }
}

#[test]
fn applies_to_three_by_three_and_five_by_five_kernels_of_stride_one_and_same_padding() {
    let g = geometry(1, (16, 16), [8, 8]);
    assert!(applies(&g));
    assert!(applies(&with_kernel(5, 1, (16, 16), [8, 8])));
    let refused = [
        Geometry {
            stride: [2, 2],
            ..g
        },
        Geometry {
            pad: [(1, 1), (0, 0)],
            ..g
        },
        Geometry {
            pad: [(1, 0), (1, 1)],
            ..g
        },
        Geometry {
            kernel: [5, 5],
            ..g
        },
        Geometry {
            kernel: [7, 7],
            pad: [(3, 3), (3, 3)],
            ..g
        },
        Geometry { c_in: 3, ..g },
    ];
    for g in refused {
        assert!(!applies(&g), "{g:?}");
    }
}

/// The routes' thresholds: resnet_20's first stage stays with the
/// column-free kernel, its later stages and the wide models' layers come
/// here, a 2 × 2 map sends only its weight gradient and a 5 × 5 kernel all
/// but its weight gradient.
#[test]
fn pays_off_from_512_channel_pairs_with_the_weight_gradient_of_3_by_3_kernels_only() {
    let first_stage = geometry(32, (16, 16), [32, 32]);
    assert!(applies(&first_stage));
    assert!(!fastest(&first_stage) && !fastest_for_weight_gradient(&first_stage));
    for g in [
        geometry(32, (32, 32), [16, 16]),
        geometry(32, (16, 32), [16, 16]),
        geometry(32, (512, 512), [4, 4]),
    ] {
        assert!(fastest(&g) && fastest_for_weight_gradient(&g), "{g:?}");
    }
    let smallest = geometry(32, (512, 512), [2, 2]);
    assert!(!fastest(&smallest) && fastest_for_weight_gradient(&smallest));
    // cnn's second layer: forward and input gradient only.
    let five = with_kernel(5, 32, (32, 64), [14, 14]);
    assert!(fastest(&five) && !fastest_for_weight_gradient(&five));
}
