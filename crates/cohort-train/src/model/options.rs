//! A model's options: the keys of `[parameters.model]` beside `num_classes`
//! (`norm = "group"`, `hidden = [200, 200]`).
//!
//! cohort-core keeps them as read, knowing no model; the model's constructor
//! asks for each option it takes, with its default, through the getters here
//! ([`ModelOptions::choice`], [`ModelOptions::sizes`]). What a constructor asks
//! for is the list of its options, so there is no second list to keep in step:
//! after a build, a key the constructor never asked for is refused, naming the
//! key, the options the model takes and the closest of them
//! ([`ModelOptions::unread`]).
//!
//! The record of what was asked belongs to one build: a clone starts with none,
//! and the registry builds every model from a fresh clone of its spec, so
//! builds on several threads never see each other's record.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use cohort_core::suggest::did_you_mean;

use super::ModelError;

/// The options a model is built with; see the module documentation.
#[derive(Debug, Default)]
pub struct ModelOptions {
    values: BTreeMap<String, toml::Value>,
    /// Keys the constructor asked for in this build, given or not.
    asked: Mutex<BTreeSet<String>>,
    /// The key whose value the constructor refused in this build.
    refused: Mutex<Option<String>>,
}

impl Clone for ModelOptions {
    /// The values, with a fresh record of what was asked.
    fn clone(&self) -> Self {
        Self::new(self.values.clone())
    }
}

impl PartialEq for ModelOptions {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl ModelOptions {
    pub fn new(values: BTreeMap<String, toml::Value>) -> Self {
        Self {
            values,
            asked: Mutex::default(),
            refused: Mutex::default(),
        }
    }

    /// The options as given.
    pub fn values(&self) -> &BTreeMap<String, toml::Value> {
        &self.values
    }

    fn ask(&self, key: &str) -> Option<&toml::Value> {
        lock(&self.asked).insert(key.to_owned());
        self.values.get(key)
    }

    fn refuse(&self, key: &str, expected: &str, found: &toml::Value) -> ModelError {
        *lock(&self.refused) = Some(key.to_owned());
        ModelError(format!(
            "parameters.model.{key} = {found}: expected {expected}"
        ))
    }

    /// The string option `key`, one of `allowed` (`default` when not given).
    pub fn choice(&self, key: &str, allowed: &[&str], default: &str) -> Result<String, ModelError> {
        let Some(value) = self.ask(key) else {
            return Ok(default.to_owned());
        };
        let expected = || {
            let quoted: Vec<String> = allowed.iter().map(|a| format!("\"{a}\"")).collect();
            format!("one of {}", quoted.join(", "))
        };
        match value.as_str() {
            Some(text) if allowed.contains(&text) => Ok(text.to_owned()),
            Some(text) => Err(self.refuse(
                key,
                &format!(
                    "{}{}",
                    expected(),
                    did_you_mean(text, allowed.iter().copied())
                ),
                value,
            )),
            None => Err(self.refuse(key, &expected(), value)),
        }
    }

    /// The option `key` as a list of positive integers (`default` when not
    /// given); an empty list is allowed only when `default` is.
    pub fn sizes(&self, key: &str, default: &[usize]) -> Result<Vec<usize>, ModelError> {
        let Some(value) = self.ask(key) else {
            return Ok(default.to_vec());
        };
        let expected = "a list of positive integers, such as [200, 200]";
        let Some(items) = value.as_array() else {
            return Err(self.refuse(key, expected, value));
        };
        let sizes: Option<Vec<usize>> = items
            .iter()
            .map(|item| {
                item.as_integer()
                    .filter(|&n| n > 0)
                    .and_then(|n| usize::try_from(n).ok())
            })
            .collect();
        match sizes {
            Some(sizes) if !sizes.is_empty() || default.is_empty() => Ok(sizes),
            _ => Err(self.refuse(key, expected, value)),
        }
    }

    /// The option `key` as a positive integer (`default` when not given).
    pub fn count(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        let Some(value) = self.ask(key) else {
            return Ok(default);
        };
        value
            .as_integer()
            .filter(|&n| n > 0)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| self.refuse(key, "a positive integer", value))
    }

    /// Whether `key` was given (it counts as asked for).
    pub fn given(&self, key: &str) -> bool {
        self.ask(key).is_some()
    }

    /// The first given key that this build never asked for, with the error
    /// that names it; `None` when every option was read.
    pub fn unread(&self) -> Option<(String, ModelError)> {
        let asked = lock(&self.asked);
        let key = self.values.keys().find(|key| !asked.contains(*key))?;
        let takes = if asked.is_empty() {
            "this model takes no options besides num_classes".to_owned()
        } else {
            let names: Vec<&str> = asked.iter().map(String::as_str).collect();
            format!("this model's options are: {}", names.join(", "))
        };
        let message = format!(
            "parameters.model.{key} is not an option of this model{}; {takes}",
            did_you_mean(key, asked.iter().map(String::as_str))
        );
        Some((key.clone(), ModelError(message)))
    }

    /// The key whose value this build refused, if a getter refused one.
    pub fn refused(&self) -> Option<String> {
        lock(&self.refused).clone()
    }
}

/// A poisoned record is still a record: a panic elsewhere leaves the set as
/// it was.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(text: &str) -> ModelOptions {
        let table: toml::Table = text.parse().unwrap();
        ModelOptions::new(table.into_iter().collect())
    }

    #[test]
    fn given_values_are_read_and_defaults_stand_in_for_the_rest() {
        let given = options("norm = \"group\"\nhidden = [64, 32]\n");
        assert_eq!(
            given.choice("norm", &["batch", "group"], "batch").unwrap(),
            "group"
        );
        assert_eq!(given.sizes("hidden", &[200]).unwrap(), vec![64, 32]);
        assert_eq!(given.sizes("other", &[7]).unwrap(), vec![7]);
        assert!(given.unread().is_none());
    }

    #[test]
    fn a_misspelt_key_is_named_with_the_options_the_model_asked_for() {
        let given = options("nrom = \"group\"\n");
        given.choice("norm", &["batch", "group"], "batch").unwrap();
        let (key, error) = given.unread().unwrap();
        assert_eq!(key, "nrom");
        let error = error.to_string();
        assert!(
            error.contains("parameters.model.nrom")
                && error.contains("did you mean `norm`?")
                && error.contains("options are: norm"),
            "{error}"
        );
        let none = options("width = 3\n");
        let error = none.unread().unwrap().1.to_string();
        assert!(error.contains("takes no options"), "{error}");
    }

    #[test]
    fn values_of_the_wrong_kind_are_refused_naming_the_key() {
        let given = options("norm = \"gruop\"\nhidden = [64, 0]\n");
        let error = given
            .choice("norm", &["batch", "group"], "batch")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("parameters.model.norm") && error.contains("`group`"),
            "{error}"
        );
        assert_eq!(given.refused().as_deref(), Some("norm"));
        let error = given.sizes("hidden", &[200]).unwrap_err().to_string();
        assert!(error.contains("parameters.model.hidden"), "{error}");
        assert!(options("hidden = []\n").sizes("hidden", &[200]).is_err());
        assert!(options("hidden = 3\n").sizes("hidden", &[200]).is_err());
        assert_eq!(options("groups = 4\n").count("groups", 2).unwrap(), 4);
        assert!(options("groups = 0\n").count("groups", 2).is_err());
        assert!(options("groups = \"2\"\n").count("groups", 2).is_err());
    }

    #[test]
    fn a_clone_has_the_values_and_a_fresh_record() {
        let given = options("norm = \"group\"\n");
        given.choice("norm", &["batch", "group"], "batch").unwrap();
        let clone = given.clone();
        assert_eq!(clone, given);
        assert_eq!(clone.unread().map(|(key, _)| key).as_deref(), Some("norm"));
    }
}
