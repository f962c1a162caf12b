//! Placeholder.
use serde::{Deserialize, Serialize};

use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgConfig {}
impl FedAvgConfig {
    #[allow(dead_code)]
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
pub struct FedAvg;
impl FedAvg {
    #[allow(dead_code)]
    pub fn new(_c: FedAvgConfig) -> Self {
        Self
    }
}
impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        "fedavg"
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
