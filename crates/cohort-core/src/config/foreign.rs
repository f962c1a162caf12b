//! What users of other frameworks write, read as cohort's words: the names
//! Flower (and flwr-datasets) give settings that cohort names otherwise, and
//! serde's Rust type names in errors, said as a config's reader says them.
//! Plato's names are not here: cohort reads those as its own (`plato.rs`).

/// (section the key was written in, the other framework's name, cohort's key,
/// what differs beyond the name).
const FLOWER_NAMES: &[(&str, &str, &str, &str)] = &[
    ("clients", "fraction_fit", "clients.per_round", FRACTION),
    ("clients", "fraction_train", "clients.per_round", FRACTION),
    ("clients", "min_fit_clients", "clients.min_per_round", ""),
    ("clients", "min_train_clients", "clients.min_per_round", ""),
    ("clients", "num_clients", "clients.total_clients", ""),
    ("clients", "num_supernodes", "clients.total_clients", ""),
    ("data", "num_partitions", "clients.total_clients", ""),
    ("data", "alpha", "data.concentration", ""),
    ("trainer", "num_rounds", "trainer.rounds", ""),
    ("server", "num_rounds", "trainer.rounds", ""),
    ("general", "num_rounds", "trainer.rounds", ""),
    ("trainer", "local_epochs", "trainer.epochs", ""),
    ("algorithm", "proximal_mu", "algorithm.mu", ""),
    ("algorithm", "eta", "algorithm.server_learning_rate", ""),
    ("algorithm", "server_momentum", "algorithm.momentum", ""),
    ("algorithm", "beta_1", "algorithm.beta1", ""),
    ("algorithm", "beta_2", "algorithm.beta2", ""),
    (
        "algorithm",
        "eta_l",
        "parameters.optimizer.learning_rate",
        " (the clients' learning rate is the optimizer's)",
    ),
];

const FRACTION: &str = ", a number of clients rather than a fraction of them";

/// `" (Flower's `proximal_mu` is cohort's `algorithm.mu`)"` when `key` in
/// `section` is a name Flower uses for one of cohort's keys.
pub(crate) fn flower_hint(section: &str, key: &str) -> Option<String> {
    FLOWER_NAMES
        .iter()
        .find(|(s, name, _, _)| *s == section && *name == key)
        .map(|(_, name, ours, differs)| {
            format!(" (Flower's `{name}` is cohort's `{ours}`{differs})")
        })
}

/// serde's message with Rust's type names said in a config's terms:
/// "expected u32" is "expected a whole number from 0 to 4294967295".
pub(crate) fn plain_types(message: &str) -> String {
    let mut text = message.to_owned();
    for (rust, plain) in [
        ("usize", "a whole number ≥ 0"),
        ("u64", "a whole number ≥ 0"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u16", "a whole number from 0 to 65535"),
        ("u8", "a whole number from 0 to 255"),
        ("i64", "a whole number"),
        ("i32", "a whole number"),
        ("f64", "a number"),
        ("f32", "a number"),
        ("PathBuf", "a path (a string)"),
        ("String", "a string"),
    ] {
        text = replace_word(
            &text,
            &format!("expected {rust}"),
            &format!("expected {plain}"),
        );
    }
    // "expected struct Clients" / "expected enum Sampler": a table, a name.
    for (rust, plain) in [
        ("expected struct ", "a table"),
        ("expected enum ", "a name"),
    ] {
        while let Some(start) = text.find(rust) {
            let name_start = start + rust.len();
            let name_end = text[name_start..]
                .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                .map_or(text.len(), |end| name_start + end);
            text.replace_range(start..name_end, &format!("expected {plain}"));
        }
    }
    text
}

/// `text` with `word` replaced wherever it is not followed by more of a
/// name (`expected u32` but not `expected u32s`).
fn replace_word(text: &str, word: &str, with: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let after = &rest[at + word.len()..];
        let whole = !after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        out.push_str(&rest[..at]);
        out.push_str(if whole { with } else { word });
        rest = after;
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_type_names_are_said_in_plain_words() {
        assert_eq!(
            plain_types("invalid type: string \"two\", expected u32"),
            "invalid type: string \"two\", expected a whole number from 0 to 4294967295"
        );
        assert_eq!(
            plain_types("invalid value: integer `-1`, expected usize"),
            "invalid value: integer `-1`, expected a whole number ≥ 0"
        );
        assert_eq!(
            plain_types("invalid type: integer `3`, expected struct Clients"),
            "invalid type: integer `3`, expected a table"
        );
        assert_eq!(plain_types("expected u32s"), "expected u32s");
        assert_eq!(
            plain_types("expected f64 or f32"),
            "expected a number or f32"
        );
    }

    #[test]
    fn flower_names_point_to_cohorts_keys() {
        assert_eq!(
            flower_hint("algorithm", "proximal_mu").unwrap(),
            " (Flower's `proximal_mu` is cohort's `algorithm.mu`)"
        );
        assert!(
            flower_hint("clients", "fraction_fit")
                .unwrap()
                .contains("`clients.per_round`, a number of clients")
        );
        assert!(
            flower_hint("data", "alpha")
                .unwrap()
                .contains("data.concentration")
        );
        assert_eq!(flower_hint("clients", "alpha"), None);
    }
}
