//! Field names of a serde struct, read from its `Deserialize` impl.
//!
//! The loader needs each section's valid keys to reject unknown ones with a
//! did-you-mean. Reading them from the derive keeps one source of truth: a field
//! added to a section struct is a valid key at once.

use serde::de::{self, Deserialize, Deserializer, Visitor};

#[derive(Debug)]
struct Captured(&'static [&'static str]);

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
    fn reads_renamed_fields() {
        let fields = fields_of::<crate::config::Clients>();
        assert!(fields.contains(&"type"));
        assert!(fields.contains(&"total_clients"));
        assert!(!fields.contains(&"kind"));
    }
}
