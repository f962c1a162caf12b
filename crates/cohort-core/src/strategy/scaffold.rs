//! Placeholder.
use serde::{Deserialize, Serialize};

use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaffoldConfig {}
impl ScaffoldConfig {
    #[allow(dead_code)]
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
pub struct Scaffold;
impl Scaffold {
    #[allow(dead_code)]
    pub fn new(_c: ScaffoldConfig) -> Self {
        Self
    }
}
impl Strategy for Scaffold {
    fn name(&self) -> &'static str {
        "scaffold"
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
