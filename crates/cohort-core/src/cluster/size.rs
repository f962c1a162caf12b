//! Memory sizes in the cluster file: a plain integer of bytes, or a number with
//! a unit such as `"64 GiB"` or `"1.5 TB"`.
//!
//! Binary units (`KiB` … `EiB`) are powers of 1024, decimal units (`KB` …
//! `EB`) powers of 1000, as the IEC defines them; units are
//! read without regard to case and the space before them is optional. The
//! arithmetic is exact in integers (no float rounding), up to nine decimals.

use serde::{Deserializer, de};

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
    ("pib", 1 << 50),
    ("eib", 1 << 60),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("pb", 1_000_000_000_000_000),
    ("eb", 1_000_000_000_000_000_000),
];

const EXPECTED: &str =
    "bytes as an integer, or a size such as \"64 GiB\", \"512 MiB\" or \"1.5 TB\"";

/// Bytes from `"64 GiB"`, `"512MiB"`, `"1.5 TB"` or `"4096"`.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let bad = || format!("invalid size `{text}`: expected {EXPECTED}");
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let scale = match unit.as_str() {
        "" => 1,
        unit => UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .map(|(_, scale)| *scale)
            .ok_or_else(bad)?,
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits_only(whole) || !digits_only(fraction) || fraction.len() > 9 {
        return Err(bad());
    }
    let too_large = || format!("size `{text}` is larger than {} bytes", u64::MAX);
    let denominator = 10u128.pow(fraction.len() as u32);
    // A whole part of more than 39 digits does not parse into u128; every
    // step after is checked, so no size overflows on the way to u64.
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let fraction: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().map_err(|_| bad())?
    };
    let bytes = whole
        .checked_mul(denominator)
        .and_then(|scaled| scaled.checked_add(fraction))
        .and_then(|scaled| scaled.checked_mul(u128::from(scale)))
        .ok_or_else(too_large)?
        / denominator;
    u64::try_from(bytes).map_err(|_| too_large())
}

/// `bytes` in the largest binary unit that keeps it at least 1, one decimal:
/// `"16.0 GiB"`, `"512.0 MiB"`, `"12 B"`.
pub fn format_bytes(bytes: u64) -> String {
    const NAMES: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = None;
    for (power, name) in NAMES.iter().enumerate() {
        if bytes >= 1u64 << (10 * (power + 1)) {
            unit = Some((power + 1, *name));
        }
    }
    match unit {
        None => format!("{bytes} B"),
        Some((power, name)) => {
            let value = bytes as f64 / (1u64 << (10 * power)) as f64;
            format!("{value:.1} {name}")
        }
    }
}

/// serde `deserialize_with` for a size: an integer or a string with a unit.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct SizeVisitor;

    impl de::Visitor<'_> for SizeVisitor {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(EXPECTED)
        }

        fn visit_u64<E: de::Error>(self, value: u64) -> Result<u64, E> {
            Ok(value)
        }

        fn visit_i64<E: de::Error>(self, value: i64) -> Result<u64, E> {
            u64::try_from(value)
                .map_err(|_| E::custom(format!("invalid size {value}: expected {EXPECTED}")))
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<u64, E> {
            parse_size(text).map_err(E::custom)
        }
    }

    deserializer.deserialize_any(SizeVisitor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_binary_and_decimal_units_exactly() {
        assert_eq!(parse_size("64 GiB"), Ok(64 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5 TiB"), Ok(3 << 39));
        assert_eq!(parse_size("2 gb"), Ok(2_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 7 B "), Ok(7));
    }

    #[test]
    fn sizes_up_to_what_a_u64_holds_are_read_and_larger_ones_refused_without_overflow() {
        assert_eq!(parse_size("15 EiB"), Ok(15 << 60));
        assert_eq!(parse_size("18 EB"), Ok(18_000_000_000_000_000_000));
        assert_eq!(parse_size("2 PiB"), Ok(2 << 50));
        assert_eq!(format_bytes(15 << 60), "15.0 EiB");
        for huge in [
            "16 EiB",
            "19 EB",
            "999999999999999999999999999999999999 EiB",
        ] {
            let error = parse_size(huge).unwrap_err();
            assert!(
                error.contains("is larger than 18446744073709551615 bytes"),
                "{error}"
            );
        }
        let error = parse_size(&"9".repeat(60)).unwrap_err();
        assert!(error.contains("is larger than"), "{error}");
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        for bad in [
            "",
            "GiB",
            "64 GB2",
            "1..5 GiB",
            "-3 GiB",
            "64 Gbit",
            "0.0000000001 GiB",
        ] {
            let error = parse_size(bad).unwrap_err();
            assert!(
                error.contains("expected bytes as an integer"),
                "{bad}: {error}"
            );
        }
        assert!(
            parse_size("20000000 TiB")
                .unwrap_err()
                .contains("larger than")
        );
    }

    #[test]
    fn formats_in_the_largest_binary_unit() {
        assert_eq!(format_bytes(12), "12 B");
        assert_eq!(format_bytes(16 << 30), "16.0 GiB");
        assert_eq!(format_bytes(1536 << 20), "1.5 GiB");
        assert_eq!(format_bytes(3 << 39), "1.5 TiB");
    }
}
