//! Seeded data augmentation of image batches: random crop after padding,
//! and horizontal flip, as torchvision's `RandomCrop(32, padding=4)` and
//! `RandomHorizontalFlip()` that Plato applies to CIFAR's training samples.
//!
//! Every draw comes from a ChaCha8 stream seeded by
//! [`crate::seeds::augmentation_stream`] (training seed, client, round,
//! epoch), so a client's augmented batches are the same in any process and
//! on any worker. Samples are normalized already, so the padding is the
//! normalized value of a black pixel (`-mean / std` of each channel), which
//! is what torchvision's zero padding before `Normalize` gives.
//!
//! What is checked: the sample shape is `[channels, height, width]`, the
//! values are whole samples, and there is one padding value a channel. What
//! cannot be: that the samples are images (a crop of token ids would be
//! meaningless; the caller decides which data sets are augmented).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Normalization;

/// Crop and flip settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Augment {
    /// Pixels of padding on each side before a crop of the original size.
    pub padding: usize,
    /// Whether half of the samples, drawn at random, are mirrored.
    pub flip: bool,
}

impl Augment {
    /// CIFAR's usual augmentation: 4 pixels of padding, horizontal flips.
    pub const CIFAR: Augment = Augment {
        padding: 4,
        flip: true,
    };
}

/// The padding value of each channel: a black pixel, normalized.
pub fn black_of(normalization: &Normalization, channels: usize) -> Vec<f32> {
    (0..channels)
        .map(|c| {
            let pick = |values: &[f32]| values[c.min(values.len() - 1)];
            -pick(&normalization.mean) / pick(&normalization.std)
        })
        .collect()
}

/// Augments every sample of `inputs` (samples of `shape` one after another)
/// in place, drawing from the stream `seed`.
pub fn augment_batch(
    augment: Augment,
    inputs: &mut [f32],
    shape: &[usize],
    black: &[f32],
    seed: u64,
) -> Result<(), String> {
    let &[channels, height, width] = shape else {
        return Err(format!(
            "augmentation needs [channels, height, width] samples, not {shape:?}"
        ));
    };
    let per_sample = channels * height * width;
    if per_sample == 0 || !inputs.len().is_multiple_of(per_sample) || black.len() != channels {
        return Err(format!(
            "{} values are not whole samples of {shape:?} with {} padding values",
            inputs.len(),
            black.len()
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut copy = vec![0.0; per_sample];
    let range = 2 * augment.padding + 1;
    for sample in inputs.chunks_exact_mut(per_sample) {
        // Offsets into the padded image, as torchvision draws them: top
        // then left, each in 0..=2 × padding; then the flip.
        let top = rng.random_range(0..range);
        let left = rng.random_range(0..range);
        let flip = augment.flip && rng.random_bool(0.5);
        copy.copy_from_slice(sample);
        for c in 0..channels {
            let plane = &copy[c * height * width..(c + 1) * height * width];
            let out = &mut sample[c * height * width..(c + 1) * height * width];
            for y in 0..height {
                for x in 0..width {
                    let source_x = if flip { width - 1 - x } else { x };
                    // Position in the unpadded image, if inside it.
                    let row = (y + top)
                        .checked_sub(augment.padding)
                        .filter(|&r| r < height);
                    let col = (source_x + left)
                        .checked_sub(augment.padding)
                        .filter(|&c| c < width);
                    out[y * width + x] = match (row, col) {
                        (Some(r), Some(col)) => plane[r * width + col],
                        _ => black[c],
                    };
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two channels of 3 × 3: values 0..9 and 10..19.
    fn sample() -> Vec<f32> {
        (0..18).map(|v| v as f32).collect()
    }

    #[test]
    fn no_padding_no_flip_leaves_samples_alone_and_flip_mirrors_rows() {
        let mut values = sample();
        let none = Augment {
            padding: 0,
            flip: false,
        };
        augment_batch(none, &mut values, &[2, 3, 3], &[-1.0, -2.0], 7).unwrap();
        assert_eq!(values, sample());
        // Over seeds, a flip-only augmentation gives the sample or its mirror.
        let mirror: Vec<f32> = sample()
            .chunks(3)
            .flat_map(|row| row.iter().rev().copied().collect::<Vec<_>>())
            .collect();
        let flip = Augment {
            padding: 0,
            flip: true,
        };
        let mut seen = [false, false];
        for seed in 0..32 {
            let mut values = sample();
            augment_batch(flip, &mut values, &[2, 3, 3], &[-1.0, -2.0], seed).unwrap();
            assert!(values == sample() || values == mirror, "{values:?}");
            seen[usize::from(values == mirror)] = true;
        }
        assert_eq!(seen, [true, true]);
    }

    #[test]
    fn crops_shift_the_image_and_fill_with_each_channels_black() {
        let crop = Augment {
            padding: 1,
            flip: false,
        };
        for seed in 0..64 {
            let mut values = sample();
            augment_batch(crop, &mut values, &[2, 3, 3], &[-1.0, -2.0], seed).unwrap();
            // Some shift (dy, dx) in -1..=1 explains every value.
            let explained = (-1i32..=1).any(|dy| {
                (-1i32..=1).any(|dx| {
                    (0..18).all(|i| {
                        let (c, y, x) = (i / 9, (i % 9) / 3, i % 3);
                        let (sy, sx) = (y as i32 + dy, x as i32 + dx);
                        let want = if (0..3).contains(&sy) && (0..3).contains(&sx) {
                            (c * 9 + sy as usize * 3 + sx as usize) as f32
                        } else {
                            [-1.0, -2.0][c]
                        };
                        values[i] == want
                    })
                })
            });
            assert!(explained, "seed {seed}: {values:?}");
        }
    }

    #[test]
    fn one_seed_one_batch_and_bad_shapes_refused() {
        let shape = [2, 8, 8];
        let batch: Vec<f32> = (0..4 * 128).map(|v| v as f32).collect();
        let run = |seed| {
            let mut values = batch.clone();
            augment_batch(Augment::CIFAR, &mut values, &shape, &[-1.0, -2.0], seed).unwrap();
            values
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
        let mut values = batch.clone();
        assert!(augment_batch(Augment::CIFAR, &mut values, &[512], &[0.0], 1).is_err());
        assert!(augment_batch(Augment::CIFAR, &mut values[1..], &shape, &[0.0; 2], 1).is_err());
        assert!(augment_batch(Augment::CIFAR, &mut values, &shape, &[0.0], 1).is_err());
    }

    #[test]
    fn black_is_minus_mean_over_std_per_channel() {
        let normalization = Normalization {
            mean: vec![0.5, 0.25],
            std: vec![0.25, 0.5],
        };
        assert_eq!(black_of(&normalization, 2), [-2.0, -0.5]);
        assert_eq!(black_of(&Normalization::single(0.5, 0.5), 3), [-1.0; 3]);
    }
}
