//! Optimizer choice and options, validated without a tensor library.
//!
//! Names and options follow MLX (the seed's native path), not PyTorch: `lr` is
//! not `learning_rate`, and defaults are MLX's. `cohort-train` turns an
//! [`OptimizerSpec`] into the update rule.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A fully specified optimizer: every option has its value, explicit or default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "lowercase")]
pub enum OptimizerSpec {
    Adam {
        learning_rate: f64,
        betas: [f64; 2],
        eps: f64,
        bias_correction: bool,
    },
    AdamW {
        learning_rate: f64,
        betas: [f64; 2],
        eps: f64,
        weight_decay: f64,
        bias_correction: bool,
    },
    /// Also what `momentum` builds, with its momentum required.
    Sgd {
        learning_rate: f64,
        momentum: f64,
        weight_decay: f64,
        dampening: f64,
        nesterov: bool,
    },
    RmsProp {
        learning_rate: f64,
        alpha: f64,
        eps: f64,
    },
    Lion {
        learning_rate: f64,
        betas: [f64; 2],
        weight_decay: f64,
    },
}

/// Names accepted in `trainer.optimizer` (case-insensitive).
pub const OPTIMIZER_NAMES: &[&str] = &["adam", "adamw", "sgd", "momentum", "rmsprop", "lion"];

/// A problem with `trainer.optimizer` or `[parameters.optimizer]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptimizerError {
    /// `trainer.optimizer` or `parameters.optimizer.<option>`.
    pub key: String,
    pub message: String,
}

impl fmt::Display for OptimizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.key, self.message)
    }
}

impl std::error::Error for OptimizerError {}

fn options_of(name: &str) -> &'static [&'static str] {
    match name {
        "adam" => &["learning_rate", "betas", "eps", "bias_correction"],
        "adamw" => &[
            "learning_rate",
            "betas",
            "eps",
            "weight_decay",
            "bias_correction",
        ],
        "sgd" | "momentum" => &[
            "learning_rate",
            "momentum",
            "weight_decay",
            "dampening",
            "nesterov",
        ],
        "rmsprop" => &["learning_rate", "alpha", "eps"],
        "lion" => &["learning_rate", "betas", "weight_decay"],
        _ => &[],
    }
}

/// PyTorch spellings people bring along, and what MLX calls them.
fn mlx_name_for(pytorch_name: &str) -> Option<&'static str> {
    match pytorch_name {
        "lr" => Some("learning_rate"),
        "beta1" | "beta2" => Some("betas"),
        "epsilon" => Some("eps"),
        _ => None,
    }
}

struct Options<'a> {
    optimizer: &'a str,
    values: &'a BTreeMap<String, toml::Value>,
}

impl Options<'_> {
    fn error(key: &str, message: impl Into<String>) -> OptimizerError {
        OptimizerError {
            key: format!("parameters.optimizer.{key}"),
            message: message.into(),
        }
    }

    fn float(&self, key: &str, default: Option<f64>) -> Result<f64, OptimizerError> {
        match self.values.get(key) {
            None => default.ok_or_else(|| {
                Self::error(key, format!("required by optimizer `{}`", self.optimizer))
            }),
            Some(toml::Value::Float(x)) => Ok(*x),
            Some(toml::Value::Integer(x)) => Ok(*x as f64),
            Some(other) => Err(Self::error(
                key,
                format!("expected a number, found {} `{other}`", other.type_str()),
            )),
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, OptimizerError> {
        match self.values.get(key) {
            None => Ok(default),
            Some(toml::Value::Boolean(b)) => Ok(*b),
            Some(other) => Err(Self::error(
                key,
                format!(
                    "expected true or false, found {} `{other}`",
                    other.type_str()
                ),
            )),
        }
    }

    fn betas(&self, default: [f64; 2]) -> Result<[f64; 2], OptimizerError> {
        let Some(value) = self.values.get("betas") else {
            return Ok(default);
        };
        let expected = || {
            Self::error(
                "betas",
                format!("expected two numbers in [0, 1), like [0.9, 0.999], found `{value}`"),
            )
        };
        let toml::Value::Array(items) = value else {
            return Err(expected());
        };
        let numbers: Vec<f64> = items
            .iter()
            .map(|item| match item {
                toml::Value::Float(x) => Some(*x),
                toml::Value::Integer(x) => Some(*x as f64),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(expected)?;
        match numbers.as_slice() {
            [b1, b2] if (0.0..1.0).contains(b1) && (0.0..1.0).contains(b2) => Ok([*b1, *b2]),
            _ => Err(expected()),
        }
    }
}

fn positive(key: &str, value: f64) -> Result<f64, OptimizerError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(Options::error(
            key,
            format!("must be a finite number > 0, got {value}"),
        ))
    }
}

fn non_negative(key: &str, value: f64) -> Result<f64, OptimizerError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(Options::error(
            key,
            format!("must be a finite number >= 0, got {value}"),
        ))
    }
}

/// `trainer.optimizer` lowered, once it and every key of
/// `[parameters.optimizer]` are names the optimizer takes.
fn checked_names(
    name: &str,
    values: &BTreeMap<String, toml::Value>,
) -> Result<String, OptimizerError> {
    let lowered = name.to_ascii_lowercase();
    if !OPTIMIZER_NAMES.contains(&lowered.as_str()) {
        return Err(OptimizerError {
            key: "trainer.optimizer".to_owned(),
            message: format!(
                "unknown optimizer `{name}`{}; expected one of: {}",
                crate::suggest::did_you_mean(&lowered, OPTIMIZER_NAMES.iter().copied()),
                OPTIMIZER_NAMES.join(", ")
            ),
        });
    }
    let valid = options_of(&lowered);
    for key in values.keys() {
        if !valid.contains(&key.as_str()) {
            let hint = match mlx_name_for(key) {
                Some(mlx) => format!(" (options use MLX names: did you mean `{mlx}`?)"),
                None => crate::suggest::did_you_mean(key, valid.iter().copied()),
            };
            return Err(Options::error(
                key,
                format!(
                    "`{lowered}` takes no option `{key}`{hint}; valid options: {}",
                    valid.join(", ")
                ),
            ));
        }
    }
    Ok(lowered)
}

impl OptimizerSpec {
    /// Builds the spec from `trainer.optimizer` and `[parameters.optimizer]`,
    /// applying MLX's defaults and rejecting options the optimizer does not take.
    pub fn from_config(
        name: &str,
        values: &BTreeMap<String, toml::Value>,
    ) -> Result<Self, OptimizerError> {
        let lowered = checked_names(name, values)?;
        let options = Options {
            optimizer: &lowered,
            values,
        };
        let learning_rate = positive("learning_rate", options.float("learning_rate", None)?)?;
        let eps = |default| -> Result<f64, OptimizerError> {
            positive("eps", options.float("eps", Some(default))?)
        };
        let weight_decay = |default| -> Result<f64, OptimizerError> {
            non_negative(
                "weight_decay",
                options.float("weight_decay", Some(default))?,
            )
        };
        Ok(match lowered.as_str() {
            "adam" => OptimizerSpec::Adam {
                learning_rate,
                betas: options.betas([0.9, 0.999])?,
                eps: eps(1e-8)?,
                bias_correction: options.bool("bias_correction", false)?,
            },
            "adamw" => OptimizerSpec::AdamW {
                learning_rate,
                betas: options.betas([0.9, 0.999])?,
                eps: eps(1e-8)?,
                weight_decay: weight_decay(0.01)?,
                bias_correction: options.bool("bias_correction", false)?,
            },
            "sgd" | "momentum" => {
                let momentum_default = if lowered == "momentum" {
                    None
                } else {
                    Some(0.0)
                };
                let momentum =
                    non_negative("momentum", options.float("momentum", momentum_default)?)?;
                let dampening = non_negative("dampening", options.float("dampening", Some(0.0))?)?;
                let nesterov = options.bool("nesterov", false)?;
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err(Options::error(
                        "nesterov",
                        format!(
                            "Nesterov momentum needs momentum > 0 and dampening = 0 (got momentum {momentum}, dampening {dampening})"
                        ),
                    ));
                }
                OptimizerSpec::Sgd {
                    learning_rate,
                    momentum,
                    weight_decay: weight_decay(0.0)?,
                    dampening,
                    nesterov,
                }
            }
            "rmsprop" => {
                let alpha = options.float("alpha", Some(0.99))?;
                if !(0.0..=1.0).contains(&alpha) {
                    return Err(Options::error(
                        "alpha",
                        format!("must be in [0, 1], got {alpha}"),
                    ));
                }
                OptimizerSpec::RmsProp {
                    learning_rate,
                    alpha,
                    eps: eps(1e-8)?,
                }
            }
            "lion" => OptimizerSpec::Lion {
                learning_rate,
                betas: options.betas([0.9, 0.99])?,
                weight_decay: weight_decay(0.0)?,
            },
            _ => unreachable!("name checked against OPTIMIZER_NAMES"),
        })
    }

    pub fn learning_rate(&self) -> f64 {
        match self {
            OptimizerSpec::Adam { learning_rate, .. }
            | OptimizerSpec::AdamW { learning_rate, .. }
            | OptimizerSpec::Sgd { learning_rate, .. }
            | OptimizerSpec::RmsProp { learning_rate, .. }
            | OptimizerSpec::Lion { learning_rate, .. } => *learning_rate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(text: &str) -> BTreeMap<String, toml::Value> {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn adam_takes_mlx_defaults() {
        let spec = OptimizerSpec::from_config("Adam", &options("learning_rate = 0.001")).unwrap();
        assert_eq!(
            spec,
            OptimizerSpec::Adam {
                learning_rate: 0.001,
                betas: [0.9, 0.999],
                eps: 1e-8,
                bias_correction: false
            }
        );
    }

    #[test]
    fn pytorch_option_name_is_refused_with_the_mlx_name() {
        let error = OptimizerSpec::from_config("sgd", &options("lr = 0.1")).unwrap_err();
        assert_eq!(error.key, "parameters.optimizer.lr");
        assert!(
            error.message.contains("did you mean `learning_rate`"),
            "{error}"
        );
        assert!(
            error
                .message
                .contains("valid options: learning_rate, momentum"),
            "{error}"
        );
    }

    #[test]
    fn option_of_another_optimizer_is_refused() {
        let error =
            OptimizerSpec::from_config("rmsprop", &options("learning_rate = 0.1\nmomentum = 0.9"))
                .unwrap_err();
        assert!(
            error
                .message
                .contains("`rmsprop` takes no option `momentum`"),
            "{error}"
        );
    }

    #[test]
    fn momentum_requires_its_momentum() {
        let error =
            OptimizerSpec::from_config("momentum", &options("learning_rate = 0.1")).unwrap_err();
        assert_eq!(error.key, "parameters.optimizer.momentum");
        let spec =
            OptimizerSpec::from_config("momentum", &options("learning_rate = 0.1\nmomentum = 0.9"))
                .unwrap();
        assert!(matches!(spec, OptimizerSpec::Sgd { momentum, .. } if momentum == 0.9));
    }

    #[test]
    fn learning_rate_is_required_and_positive() {
        assert!(OptimizerSpec::from_config("adam", &options("")).is_err());
        assert!(OptimizerSpec::from_config("adam", &options("learning_rate = -1.0")).is_err());
    }

    #[test]
    fn unknown_optimizer_suggests_a_name() {
        let error =
            OptimizerSpec::from_config("adma", &options("learning_rate = 0.1")).unwrap_err();
        assert!(error.message.contains("did you mean `adam`"), "{error}");
    }

    #[test]
    fn bad_betas_and_nesterov_without_momentum_are_refused() {
        assert!(
            OptimizerSpec::from_config("adam", &options("learning_rate = 0.1\nbetas = [0.9]"))
                .is_err()
        );
        assert!(
            OptimizerSpec::from_config("sgd", &options("learning_rate = 0.1\nnesterov = true"))
                .is_err()
        );
    }
}
