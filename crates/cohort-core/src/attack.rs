//! Simulated Byzantine clients, for experiments with robust strategies.
//!
//! With `clients.attack` set, the first `clients.attackers_per_round` clients
//! of each round's selection (a random subset, since selection is random)
//! replace their honest update `Δ = xᵢ − x` by a malicious one:
//!
//! * `scale`: `x + s·Δ` (a boosted update, as in model-replacement attacks);
//! * `sign_flip`: `x − s·Δ` (the update pointing uphill);
//!
//! with `s = clients.attack_scale`. The server applies it on arrival, before the
//! hooks and the strategy, so every strategy sees the same attacked round in
//! simulation and over the network. Off by default.

use serde::{Deserialize, Serialize};

use crate::tree::ParamTree;

/// `clients.attack`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attack {
    #[default]
    None,
    Scale,
    SignFlip,
}

/// `update` as an attacker would send it: float leaves moved, others kept.
pub fn apply(attack: Attack, scale: f64, global: &ParamTree, update: ParamTree) -> ParamTree {
    match attack {
        Attack::None => update,
        Attack::Scale => crate::strategy::scale_update(global, update, scale),
        Attack::SignFlip => crate::strategy::scale_update(global, update, -scale),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Array;

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    #[test]
    fn attacks_by_hand() {
        let global = tree(&[1.0, 1.0]);
        // Δ = (1, −0.5).
        let honest = tree(&[2.0, 0.5]);
        assert_eq!(
            apply(Attack::Scale, 10.0, &global, honest.clone()),
            tree(&[11.0, -4.0])
        );
        assert_eq!(
            apply(Attack::SignFlip, 1.0, &global, honest.clone()),
            tree(&[0.0, 1.5])
        );
        assert_eq!(apply(Attack::None, 10.0, &global, honest.clone()), honest);
    }
}
