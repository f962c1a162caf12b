//! What the core benches share: LeNet-5's parameter layout and the timing rule.

use std::time::Instant;

use cohort_core::tree::{Array, ParamTree};

/// LeNet-5's parameter layout (61,706 float32 values), element `i` of each
/// leaf `value(i)`.
pub fn lenet5_like(value: impl Fn(usize) -> f32) -> ParamTree {
    let shapes: [(&str, &[usize]); 10] = [
        ("conv1.weight", &[6, 1, 5, 5]),
        ("conv1.bias", &[6]),
        ("conv2.weight", &[16, 6, 5, 5]),
        ("conv2.bias", &[16]),
        ("conv3.weight", &[120, 16, 5, 5]),
        ("conv3.bias", &[120]),
        ("fc4.weight", &[120, 84]),
        ("fc4.bias", &[84]),
        ("fc5.weight", &[84, 10]),
        ("fc5.bias", &[10]),
    ];
    ParamTree::from_dotted(shapes.iter().map(|(name, shape)| {
        let len: usize = shape.iter().product();
        let values = (0..len).map(&value).collect();
        (
            name.to_string(),
            Array::f32(shape.to_vec(), values).unwrap(),
        )
    }))
}

/// Best of `repeats` timings, in seconds.
pub fn best_of(repeats: usize, mut work: impl FnMut()) -> f64 {
    (0..repeats)
        .map(|_| {
            let started = Instant::now();
            work();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
