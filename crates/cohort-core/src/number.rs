//! Numbers as people read them in error messages.

/// `value` in plain notation when that is short (`0.05`, `600`), in
/// scientific notation when plain would run to hundreds of digits
/// (`1e-310`, `1.7e308`).
pub fn shown(value: f64) -> String {
    let magnitude = value.abs();
    if value.is_finite() && magnitude != 0.0 && !(1e-4..1e15).contains(&magnitude) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn short_numbers_stay_plain_and_extreme_ones_turn_scientific() {
        assert_eq!(shown(600.0), "600");
        assert_eq!(shown(0.05), "0.05");
        assert_eq!(shown(-2.5), "-2.5");
        assert_eq!(shown(0.0), "0");
        assert_eq!(shown(f64::NAN), "NaN");
        assert_eq!(shown(f64::NEG_INFINITY), "-inf");
        assert_eq!(shown(1e-310), "1e-310");
        assert_eq!(shown(1.7e308), "1.7e308");
    }
}
