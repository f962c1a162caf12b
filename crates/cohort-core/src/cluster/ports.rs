//! Ports for an instance's ranks: deterministic, and clear of ports in use.
//!
//! exo picked random ephemeral ports without checking them; two instances on
//! the same machines could collide, and a rerun got other ports. Here the
//! ports depend only on the instance id, the base port and the ports the
//! caller says are taken (for example by another instance's plan): the
//! instance id hashes to an offset inside `base..base + PORT_SPAN`, and ports
//! are taken upwards from there, wrapping inside the span, skipping used ones.

use std::collections::BTreeSet;

/// Width of the port range above the base port that instances share.
pub const PORT_SPAN: u16 = 1024;

/// Default base port: 27500..28524 lies below Linux's ephemeral range
/// (32768 and up), so outgoing connections do not take the ports first.
pub const DEFAULT_BASE_PORT: u16 = 27_500;

/// FNV-1a, 64 bits: stable across platforms and Rust versions, unlike std's
/// `DefaultHasher`, so a plan made today gives the same ports tomorrow.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `count` distinct ports for `instance`, none in `in_use`; `None` when the
/// span has fewer than `count` free ports. The caller checks that
/// `base + PORT_SPAN` fits in a port number.
pub(crate) fn choose_ports(
    instance: &str,
    base: u16,
    count: usize,
    in_use: &BTreeSet<u16>,
) -> Option<Vec<u16>> {
    let offset = (fnv1a(instance) % u64::from(PORT_SPAN)) as u16;
    let ports: Vec<u16> = (0..PORT_SPAN)
        .map(|step| base + (offset + step) % PORT_SPAN)
        .filter(|port| !in_use.contains(port))
        .take(count)
        .collect();
    (ports.len() == count).then_some(ports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_instance_gets_the_same_ports() {
        let none = BTreeSet::new();
        let first = choose_ports("run-a", 27_500, 3, &none).unwrap();
        assert_eq!(first, choose_ports("run-a", 27_500, 3, &none).unwrap());
        assert!(
            first
                .iter()
                .all(|p| (27_500..27_500 + PORT_SPAN).contains(p))
        );
    }

    #[test]
    fn ports_in_use_are_skipped_and_the_span_can_run_out() {
        let first = choose_ports("run-a", 27_500, 2, &BTreeSet::new()).unwrap();
        let taken: BTreeSet<u16> = first.iter().copied().collect();
        let again = choose_ports("run-a", 27_500, 2, &taken).unwrap();
        assert!(again.iter().all(|p| !taken.contains(p)), "{again:?}");
        let all: BTreeSet<u16> = (27_500..27_500 + PORT_SPAN).collect();
        assert_eq!(choose_ports("run-a", 27_500, 1, &all), None);
    }

    #[test]
    fn ports_wrap_inside_the_span() {
        let base = 10_000;
        let mut taken: BTreeSet<u16> = (base..base + PORT_SPAN).collect();
        taken.remove(&base);
        taken.remove(&(base + PORT_SPAN - 1));
        let mut ports = choose_ports("x", base, 2, &taken).unwrap();
        ports.sort_unstable();
        assert_eq!(ports, [base, base + PORT_SPAN - 1]);
    }
}
