//! Placeholder.
use serde::{Deserialize, Serialize};

use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgMConfig {}
impl FedAvgMConfig {
    #[allow(dead_code)]
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
pub struct FedAvgM;
impl FedAvgM {
    #[allow(dead_code)]
    pub fn new(_c: FedAvgMConfig) -> Self {
        Self
    }
}
impl Strategy for FedAvgM {
    fn name(&self) -> &'static str {
        "fedavgm"
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
