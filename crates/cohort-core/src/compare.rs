//! How far apart two models are: the numbers behind "the GPU run matches the
//! CPU run within a tolerance" and `cohort compare`.
//!
//! Float kernels on different devices sum in different orders, so two correct
//! runs agree only up to rounding; these statistics say how far, leaf by leaf.

use crate::tree::{ArrayData, DTypeRule, ParamTree, SchemaMismatch, TreePath, check_schema};

/// Differences between the leaves of two trees of the same schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Largest `|a - b|` over all elements.
    pub max_abs: f64,
    /// Where `max_abs` was found.
    pub max_abs_at: Option<TreePath>,
    /// `‖a - b‖₂ / ‖a‖₂` over all elements together (0 when both are zero).
    pub relative_l2: f64,
    /// Elements compared.
    pub elements: usize,
    /// Elements that differ at all (bitwise for floats).
    pub differing: usize,
}

impl Comparison {
    /// True when the trees are the same bit for bit.
    pub fn identical(&self) -> bool {
        self.differing == 0
    }
}

fn as_f64(data: &ArrayData) -> Vec<f64> {
    match data {
        ArrayData::F32(v) => v.iter().map(|&x| x as f64).collect(),
        ArrayData::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        ArrayData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        ArrayData::I64(v) => v.iter().map(|&x| x as f64).collect(),
        ArrayData::I32(v) => v.iter().map(|&x| x as f64).collect(),
        ArrayData::U8(v) => v.iter().map(|&x| x as f64).collect(),
        ArrayData::Bool(v) => v.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect(),
    }
}

/// Compares `candidate` with `reference`; their schemas (kinds, keys, shapes,
/// dtypes) must agree exactly.
pub fn compare(reference: &ParamTree, candidate: &ParamTree) -> Result<Comparison, SchemaMismatch> {
    check_schema(reference, candidate, DTypeRule::Exact)?;
    let mut result = Comparison {
        max_abs: 0.0,
        max_abs_at: None,
        relative_l2: 0.0,
        elements: 0,
        differing: 0,
    };
    let (mut diff_sq, mut ref_sq) = (0.0f64, 0.0f64);
    for ((path, a), (_, b)) in reference.leaves().into_iter().zip(candidate.leaves()) {
        let (a, b) = (as_f64(a.data()), as_f64(b.data()));
        result.elements += a.len();
        for (x, y) in a.iter().zip(&b) {
            let diff = (x - y).abs();
            // NaN in either makes the difference NaN; it must not read as "equal".
            let diff = if diff.is_nan() && !(x.is_nan() && y.is_nan()) {
                f64::INFINITY
            } else if diff.is_nan() {
                0.0
            } else {
                diff
            };
            if diff > result.max_abs || (result.max_abs_at.is_none() && diff > 0.0) {
                result.max_abs = diff;
                result.max_abs_at = Some(path.clone());
            }
            diff_sq += diff * diff;
            ref_sq += x * x;
        }
        // Widening to f64 is exact, so comparing f64 bits compares the originals.
        result.differing += a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
    }
    result.relative_l2 = if ref_sq > 0.0 {
        (diff_sq / ref_sq).sqrt()
    } else if diff_sq > 0.0 {
        f64::INFINITY
    } else {
        0.0
    };
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Array;

    fn tree(values: &[(&str, Vec<f32>)]) -> ParamTree {
        ParamTree::from_dotted(values.iter().map(|(name, v)| {
            (
                name.to_string(),
                Array::f32(vec![v.len()], v.clone()).unwrap(),
            )
        }))
    }

    #[test]
    fn identical_trees_compare_as_identical() {
        let a = tree(&[("w", vec![1.0, -2.0]), ("b", vec![0.5])]);
        let result = compare(&a, &a.clone()).unwrap();
        assert!(result.identical());
        assert_eq!(result.max_abs, 0.0);
        assert_eq!(result.relative_l2, 0.0);
        assert_eq!(result.elements, 3);
    }

    #[test]
    fn differences_are_measured_and_located() {
        let a = tree(&[("w", vec![3.0, 0.0]), ("b", vec![4.0])]);
        let b = tree(&[("w", vec![3.0, 0.5]), ("b", vec![4.0])]);
        let result = compare(&a, &b).unwrap();
        assert_eq!(result.differing, 1);
        assert_eq!(result.max_abs, 0.5);
        assert_eq!(result.max_abs_at.unwrap().to_string(), "w");
        assert!((result.relative_l2 - 0.1).abs() < 1e-12);
    }

    #[test]
    fn nan_is_never_close() {
        let a = tree(&[("w", vec![1.0])]);
        let b = tree(&[("w", vec![f32::NAN])]);
        assert_eq!(compare(&a, &b).unwrap().max_abs, f64::INFINITY);
    }

    #[test]
    fn schemas_must_agree() {
        let a = tree(&[("w", vec![1.0])]);
        let b = tree(&[("v", vec![1.0])]);
        assert!(compare(&a, &b).is_err());
    }
}
