//! Placeholder.
use serde::{Deserialize, Serialize};

use super::registry::OptionError;
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedOptConfig {}
impl FedOptConfig {
    pub fn check(&self) -> Result<(), OptionError> {
        Ok(())
    }
}
pub enum ServerOptimizer { Adam, Yogi, Adagrad }
pub struct FedOpt;
impl FedOpt {
    pub fn new(_o: ServerOptimizer, _c: FedOptConfig) -> Self {
        Self
    }
}
impl Strategy for FedOpt {
    fn name(&self) -> &'static str {
        "fedadam"
    }
    fn aggregate(
        &mut self,
        _: &RoundContext,
        _: &ParamTree,
        _: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        unimplemented!()
    }
}
