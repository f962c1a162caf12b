//! Field and variant names of serde types, read from their `Deserialize` impls.
//!
//! The loader needs each section's valid keys, and the registered strategies
//! with their options, to reject unknown ones with a did-you-mean. Reading them
//! from the derive keeps one source of truth: a field added to a section
//! struct, or a strategy added to the registry, is valid at once.

use serde::de::{self, Deserialize, Deserializer, Visitor};

#[derive(Debug)]
struct Captured(&'static [&'static str]);

/// What a probe of an enum captured: its variant names, or the fields of one
/// variant.
#[derive(Debug)]
enum Probe {
    Variants(&'static [&'static str]),
    Fields(&'static [&'static str]),
    Nothing,
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("enum probed")
    }
}

impl std::error::Error for Probe {}

impl de::Error for Probe {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Probe::Nothing
    }

    fn unknown_variant(_variant: &str, expected: &'static [&'static str]) -> Self {
        Probe::Variants(expected)
    }

    fn unknown_field(_field: &str, expected: &'static [&'static str]) -> Self {
        Probe::Fields(expected)
    }
}

/// A name no variant or field has.
const NO_SUCH_NAME: &str = "\u{0}";

/// The variant names of an enum tagged by `tag` (`#[serde(tag = "...")]`), read
/// from its `Deserialize` impl by asking for a variant that does not exist.
pub fn variants_of<'de, T: Deserialize<'de>>(tag: &'static str) -> &'static [&'static str] {
    let probe = de::value::MapDeserializer::<_, Probe>::new(std::iter::once((tag, NO_SUCH_NAME)));
    match T::deserialize(probe) {
        Err(Probe::Variants(names)) => names,
        _ => &[],
    }
}

/// The fields of the variant `variant` of an enum tagged by `tag`, read by
/// offering it a field that does not exist (the variant's struct must deny
/// unknown fields).
pub fn variant_fields_of<'de, T: Deserialize<'de>>(
    tag: &'static str,
    variant: &'de str,
) -> &'static [&'static str] {
    let probe = de::value::MapDeserializer::<_, Probe>::new(
        [(tag, variant), (NO_SUCH_NAME, NO_SUCH_NAME)].into_iter(),
    );
    match T::deserialize(probe) {
        Err(Probe::Fields(names)) => names,
        _ => &[],
    }
}

/// The names of a plain (unit-variant) enum, read by asking for one that does
/// not exist.
pub fn unit_variants_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let probe = de::value::StrDeserializer::<Probe>::new(NO_SUCH_NAME);
    match T::deserialize(probe) {
        Err(Probe::Variants(names)) => names,
        _ => &[],
    }
}

/// A unit variant from its serialized name, with the valid names in the error.
pub fn parse_unit_variant<T: serde::de::DeserializeOwned>(name: &str) -> Result<T, String> {
    T::deserialize(de::value::StrDeserializer::<de::value::Error>::new(name))
        .map_err(|error| error.to_string())
}

/// The serialized name of a unit variant.
pub fn unit_variant_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => name,
        other => format!("{other:?}"),
    }
}

impl std::fmt::Display for Captured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("field names captured")
    }
}

impl std::error::Error for Captured {}

impl de::Error for Captured {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Captured(&[])
    }
}

struct FieldCapture;

impl<'de> Deserializer<'de> for FieldCapture {
    type Error = Captured;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Captured> {
        Err(Captured(&[]))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Captured> {
        Err(Captured(fields))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

/// The serialized field names of `T`, or an empty list when `T` is not a struct.
pub fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    match T::deserialize(FieldCapture) {
        Ok(_) => &[],
        Err(Captured(fields)) => fields,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_variants_and_their_fields() {
        use crate::strategy::AlgorithmConfig;
        let names = variants_of::<AlgorithmConfig>("type");
        assert!(
            names.contains(&"fedavg") && names.contains(&"trimmed_mean"),
            "{names:?}"
        );
        let fields = variant_fields_of::<AlgorithmConfig>("type", "fedprox");
        assert_eq!(fields, ["mu"]);
        assert!(variant_fields_of::<AlgorithmConfig>("type", "fedavg").is_empty());
    }

    #[test]
    fn reads_renamed_fields() {
        let fields = fields_of::<crate::config::Clients>();
        assert!(fields.contains(&"type"));
        assert!(fields.contains(&"total_clients"));
        assert!(!fields.contains(&"kind"));
    }
}
