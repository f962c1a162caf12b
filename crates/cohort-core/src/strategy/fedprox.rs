//! Placeholder.
use serde::{Deserialize, Serialize};

use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedProxConfig {}
impl FedProxConfig {
    #[allow(dead_code)]
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
pub struct FedProx;
impl FedProx {
    #[allow(dead_code)]
    pub fn new(_c: FedProxConfig) -> Self {
        Self
    }
}
impl Strategy for FedProx {
    fn name(&self) -> &'static str {
        "fedprox"
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
