//! Placeholder: being written (dp_fedavg).
use serde::{Deserialize, Serialize};

use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DpFedAvgConfig {
    pub clip_norm: f64,
    pub noise_multiplier: f64,
    pub delta: f64,
    pub noise_seed: u64,
}
impl DpFedAvgConfig {
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
pub struct DpFedAvg(DpFedAvgConfig);
impl DpFedAvg {
    pub fn new(c: DpFedAvgConfig) -> Self {
        Self(c)
    }
}
impl Strategy for DpFedAvg {
    fn name(&self) -> &'static str {
        "dp_fedavg"
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
