//! `--set section.key=value`: config keys given on the command line.
//!
//! An override replaces one key of the merged config (after `include`s), so it
//! wins over the file and its includes, and then goes through the same checks
//! as the file: an unknown key or a bad value is an error naming the key and
//! the `--set` that gave it. The run records the merged result in its
//! `config.toml`, so what ran is what the folder says.

use std::fmt;
use std::str::FromStr;

/// Most dots in an overridden key: `parameters.optimizer.betas` is the deepest
/// real one; a longer chain is a typo, not a config.
const MAX_KEY_DEPTH: usize = 4;

/// One `section.key=value` (`--set`) or `section.key` (`--unset`) from the
/// command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// Dotted key, such as `trainer.rounds`.
    pub key: String,
    /// The new value; `None` takes the key out of the config, so its default
    /// (or nothing, for an optional key) applies.
    pub value: Option<toml::Value>,
}

impl Override {
    /// The override that `--rounds N` stands for.
    pub fn rounds(rounds: u32) -> Self {
        Self {
            key: "trainer.rounds".to_owned(),
            value: Some(toml::Value::Integer(rounds.into())),
        }
    }

    /// `--unset KEY`: `key` checked as `--set` checks its key.
    pub fn unset(key: &str) -> Result<Self, String> {
        Ok(Self {
            key: checked_key(key.trim())?.to_owned(),
            value: None,
        })
    }

    /// Where an error about this key came from, for the error's file field.
    pub fn origin(&self) -> String {
        match &self.value {
            Some(value) => format!("--set {}={value}", self.key),
            None => format!("--unset {}", self.key),
        }
    }

    fn segments(&self) -> Vec<&str> {
        self.key.split('.').collect()
    }
}

impl fmt::Display for Override {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            Some(value) => write!(f, "{}={value}", self.key),
            None => write!(f, "{} (unset)", self.key),
        }
    }
}

impl FromStr for Override {
    type Err = String;

    /// `key=value`, where the value is read as TOML (`5`, `0.1`, `true`,
    /// `"text"`, `[1, 2]`) and, when it is not TOML, as a plain string, so
    /// `data.datasource=MNIST` needs no shell-quoted quotes.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let Some((key, raw)) = text.split_once('=') else {
            return Err(format!(
                "`{text}` is not KEY=VALUE (for example trainer.rounds=10)"
            ));
        };
        let key = checked_key(key.trim())?;
        let raw = raw.trim();
        let value = format!("value = {raw}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut table| table.remove("value"))
            .unwrap_or_else(|| toml::Value::String(raw.to_owned()));
        Ok(Self {
            key: key.to_owned(),
            value: Some(value),
        })
    }
}

/// `key` if it is `section.key` (up to [`MAX_KEY_DEPTH`] segments of
/// letters, digits, `_` and `-`).
fn checked_key(key: &str) -> Result<&str, String> {
    let segments: Vec<&str> = key.split('.').collect();
    let well_formed = segments.iter().all(|s| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    });
    if segments.len() < 2 || !well_formed {
        return Err(format!(
            "`{key}` is not a config key: expected section.key, such as trainer.rounds"
        ));
    }
    if segments.len() > MAX_KEY_DEPTH {
        return Err(format!(
            "`{key}` is nested {} deep; config keys are at most {MAX_KEY_DEPTH}",
            segments.len()
        ));
    }
    Ok(key)
}

/// Writes each override into `merged`, creating subsections it names, or
/// takes an unset key out; fails on the first one that names a section not in
/// `sections`, would replace a section with a value, descends into a value as
/// if it were a section, or unsets a key the config does not set (a typo
/// would otherwise change nothing, silently).
pub(crate) fn apply(
    merged: &mut toml::Table,
    overrides: &[Override],
    sections: &[&str],
) -> Result<(), String> {
    for item in overrides {
        let segments = item.segments();
        if !sections.contains(&segments[0]) {
            return Err(format!(
                "`{}`: unknown section `{}`{}; sections are: {}",
                item.key,
                segments[0],
                crate::suggest::did_you_mean(segments[0], sections.iter().copied()),
                sections.join(", ")
            ));
        }
        let (last, parents) = segments
            .split_last()
            .expect("parsed keys have two segments");
        let Some(value) = &item.value else {
            unset(merged, &segments)?;
            continue;
        };
        let mut table = &mut *merged;
        for (depth, segment) in parents.iter().enumerate() {
            let entry = table
                .entry(segment.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(inner) = entry else {
                return Err(format!(
                    "`{}` is a value ({}), not a section",
                    segments[..=depth].join("."),
                    entry.type_str()
                ));
            };
            table = inner;
        }
        if let Some(toml::Value::Table(_)) = table.get(*last) {
            return Err(format!(
                "`{}` is a section; set one of its keys, such as {}.KEY=VALUE",
                item.key, item.key
            ));
        }
        table.insert(last.to_string(), value.clone());
    }
    Ok(())
}

/// Takes the key at `segments` out of `merged`; an error names the key when
/// the config does not set it, with the keys its section does set.
fn unset(merged: &mut toml::Table, segments: &[&str]) -> Result<(), String> {
    let key = segments.join(".");
    let (last, parents) = segments
        .split_last()
        .expect("parsed keys have two segments");
    let mut table = &mut *merged;
    for segment in parents {
        match table.get_mut(*segment) {
            Some(toml::Value::Table(inner)) => table = inner,
            _ => {
                return Err(format!(
                    "`{key}` cannot be unset: the config does not set it"
                ));
            }
        }
    }
    if table.remove(*last).is_some() {
        return Ok(());
    }
    let set: Vec<&str> = table.keys().map(String::as_str).collect();
    Err(format!(
        "`{key}` cannot be unset: the config does not set it{}",
        if set.is_empty() {
            String::new()
        } else {
            format!(
                "{}; `{}` sets {}",
                crate::suggest::did_you_mean(last, set.iter().copied()),
                parents.join("."),
                set.join(", ")
            )
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECTIONS: &[&str] = &["trainer", "parameters", "data", "clients", "server"];

    fn parse(text: &str) -> Override {
        text.parse().unwrap()
    }

    #[test]
    fn values_are_read_as_toml_and_otherwise_as_strings() {
        let value = |text: &str| parse(text).value.unwrap();
        assert_eq!(value("trainer.rounds=7"), toml::Value::Integer(7));
        assert_eq!(value("trainer.lr = 0.5"), toml::Value::Float(0.5));
        assert_eq!(value("clients.do_test=true"), toml::Value::Boolean(true));
        let string = |s: &str| toml::Value::String(s.to_owned());
        assert_eq!(value("data.datasource=MNIST"), string("MNIST"));
        assert_eq!(value("data.datasource=\"MNIST\""), string("MNIST"));
        assert_eq!(value("server.address=127.0.0.1"), string("127.0.0.1"));
        assert_eq!(
            value("data.partition_sizes=[1, 2]"),
            toml::Value::Array(vec![toml::Value::Integer(1), toml::Value::Integer(2)])
        );
        // Everything after the first `=` is the value.
        assert_eq!(value("server.auth_token=a=b"), string("a=b"));
    }

    #[test]
    fn malformed_overrides_say_what_is_expected() {
        for (text, expected) in [
            ("trainer.rounds", "not KEY=VALUE"),
            ("rounds=3", "expected section.key"),
            ("trainer..rounds=3", "expected section.key"),
            ("trainer.ro unds=3", "expected section.key"),
            ("a.b.c.d.e=1", "at most 4"),
        ] {
            let error = text.parse::<Override>().unwrap_err();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }

    #[test]
    fn overrides_replace_keys_and_create_sections() {
        let mut merged: toml::Table = "[trainer]\nrounds = 5\nepochs = 1\n".parse().unwrap();
        let overrides = [
            parse("trainer.rounds=9"),
            parse("parameters.optimizer.momentum=0.5"),
        ];
        apply(&mut merged, &overrides, SECTIONS).unwrap();
        let expected: toml::Table =
            "[trainer]\nrounds = 9\nepochs = 1\n[parameters.optimizer]\nmomentum = 0.5\n"
                .parse()
                .unwrap();
        assert_eq!(merged, expected);
    }

    #[test]
    fn an_override_cannot_turn_a_value_into_a_section_or_back() {
        let mut merged: toml::Table = "[trainer]\nrounds = 5\n[parameters.optimizer]\nlr = 1\n"
            .parse()
            .unwrap();
        let error = apply(&mut merged, &[parse("trainer.rounds.x=1")], SECTIONS).unwrap_err();
        assert!(
            error.contains("`trainer.rounds` is a value (integer)"),
            "{error}"
        );
        let error = apply(&mut merged, &[parse("parameters.optimizer=1")], SECTIONS).unwrap_err();
        assert!(
            error.contains("`parameters.optimizer` is a section"),
            "{error}"
        );
        let error = apply(&mut merged, &[parse("trainr.rounds=1")], SECTIONS).unwrap_err();
        assert!(error.contains("did you mean `trainer`"), "{error}");
    }

    #[test]
    fn unset_takes_a_key_out_and_refuses_one_that_is_not_set() {
        let mut merged: toml::Table =
            "[data]\npartition_size = 600\nsampler = \"iid\"\n[parameters.optimizer]\nlr = 1\n"
                .parse()
                .unwrap();
        let unset = |key: &str| Override::unset(key).unwrap();
        apply(
            &mut merged,
            &[
                unset("data.partition_size"),
                unset("parameters.optimizer.lr"),
            ],
            SECTIONS,
        )
        .unwrap();
        let expected: toml::Table = "[data]\nsampler = \"iid\"\n[parameters.optimizer]\n"
            .parse()
            .unwrap();
        assert_eq!(merged, expected);
        let error = apply(&mut merged, &[unset("data.sampeler")], SECTIONS).unwrap_err();
        assert!(
            error.contains("`data.sampeler` cannot be unset: the config does not set it")
                && error.contains("did you mean `sampler`"),
            "{error}"
        );
        let error = apply(&mut merged, &[unset("clients.per_round")], SECTIONS).unwrap_err();
        assert!(error.contains("does not set it"), "{error}");
        assert!(Override::unset("rounds").is_err());
        assert_eq!(unset("data.sampler").origin(), "--unset data.sampler");
    }
}
