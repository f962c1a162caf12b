//! The Winograd convolution against im2col's on ragged shapes: odd map
//! sides (a last tile half outside the map), 1 × 1 to 32 × 32 maps,
//! channels that differ in and out, batches of several groups.

use super::direct_tests::{Path, Results, assert_close, run_on};
use super::im2col::Geometry;
use super::winograd::{applies, fastest, fastest_for_weight_gradient};

fn geometry(batch: usize, (c_in, c_out): (usize, usize), size: [usize; 2]) -> Geometry {
    Geometry {
        batch,
        c_in,
        height: size[0],
        width: size[1],
        c_out,
        kernel: [3, 3],
        stride: [1, 1],
        pad: [(1, 1), (1, 1)],
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
        // More channels out than in, and the reverse.
        geometry(2, (8, 70), [6, 6]),
        geometry(2, (70, 8), [6, 6]),
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
        let ours = run(g, i as u64, true);
        let theirs = run(g, i as u64, false);
        assert_close(&ours, &theirs, g);
    }
}

#[test]
fn gives_the_same_bits_every_run() {
    let g = geometry(6, (16, 24), [10, 10]);
    assert_eq!(run(&g, 7, true), run(&g, 7, true));
}

#[test]
fn applies_to_three_by_three_kernels_of_stride_one_and_padding_one() {
    let g = geometry(1, (16, 16), [8, 8]);
    assert!(applies(&g));
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
            pad: [(2, 2), (2, 2)],
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
/// here, and a 2 × 2 map sends only its weight gradient.
#[test]
fn pays_off_from_512_channel_pairs_and_for_2_by_2_maps_only_in_the_weight_gradient() {
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
}
