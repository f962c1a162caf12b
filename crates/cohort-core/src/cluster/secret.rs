//! The ring secret: 32 random bytes `cohort place --emit` draws from the OS
//! for each plan and writes, hex, into every host file of it. Ranks of the
//! `ring` backend prove to each other that they hold it (an HMAC-SHA256
//! challenge–response in the ring's hello) before any update crosses, so a
//! process that knows only the plan's instance and ranks can neither join
//! the ring nor receive its updates. It authenticates; it does not encrypt:
//! updates cross in the clear (see docs/SECURITY.md, "Cluster ranks").

use rand::TryRngCore;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes of a ring secret.
pub const RING_SECRET_BYTES: usize = 32;

/// A plan's ring secret. Its `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct RingSecret([u8; RING_SECRET_BYTES]);

impl RingSecret {
    /// A fresh secret from the operating system's random source.
    pub fn generate() -> Result<Self, String> {
        let mut bytes = [0u8; RING_SECRET_BYTES];
        rand::rngs::OsRng.try_fill_bytes(&mut bytes).map_err(|e| {
            format!("the operating system gave no random bytes for the ring secret: {e}")
        })?;
        Ok(Self(bytes))
    }

    /// A secret of these bytes (tests, and ranks that read one).
    pub fn from_bytes(bytes: [u8; RING_SECRET_BYTES]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; RING_SECRET_BYTES] {
        &self.0
    }

    /// Lower-case hex, as host files hold it.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Reads [`RingSecret::to_hex`]'s form: 64 hex digits.
    pub fn from_hex(text: &str) -> Result<Self, String> {
        let digits = text.as_bytes();
        if digits.len() != 2 * RING_SECRET_BYTES || !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err(format!(
                "a ring secret is {} hex digits; this one is {} characters",
                2 * RING_SECRET_BYTES,
                text.chars().count()
            ));
        }
        let mut bytes = [0u8; RING_SECRET_BYTES];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            let pair = std::str::from_utf8(pair).expect("hex digits are ASCII");
            *byte = u8::from_str_radix(pair, 16).expect("checked hex digits");
        }
        Ok(Self(bytes))
    }
}

impl std::fmt::Debug for RingSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RingSecret(<redacted>)")
    }
}

impl Serialize for RingSecret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for RingSecret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_fresh_and_read_back_from_hex() {
        let (a, b) = (
            RingSecret::generate().unwrap(),
            RingSecret::generate().unwrap(),
        );
        assert_ne!(a, b);
        assert_eq!(RingSecret::from_hex(&a.to_hex()).unwrap(), a);
        assert_eq!(a.to_hex().len(), 64);
        assert!(!format!("{a:?}").contains(&a.to_hex()));
        for bad in ["", "00", &"g".repeat(64), &"0".repeat(66)] {
            assert!(RingSecret::from_hex(bad).is_err(), "{bad}");
        }
    }
}
