//! Placeholder: being written (robust aggregation).
use serde::{Deserialize, Serialize};

use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MedianConfig {}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrimmedMeanConfig {
    pub beta: f64,
}
impl TrimmedMeanConfig {
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KrumConfig {
    pub byzantine: u32,
}
impl KrumConfig {
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiKrumConfig {
    pub byzantine: u32,
    pub selected: Option<u32>,
}
impl MultiKrumConfig {
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        Ok(())
    }
}
pub struct Median;
pub struct TrimmedMean(TrimmedMeanConfig);
impl TrimmedMean {
    pub fn new(c: TrimmedMeanConfig) -> Self {
        Self(c)
    }
}
pub struct Krum(KrumConfig);
impl Krum {
    pub fn new(c: KrumConfig) -> Self {
        Self(c)
    }
}
pub struct MultiKrum(MultiKrumConfig);
impl MultiKrum {
    pub fn new(c: MultiKrumConfig) -> Self {
        Self(c)
    }
}
macro_rules! unfinished {
    ($t:ty, $n:literal) => {
        impl Strategy for $t {
            fn name(&self) -> &'static str {
                $n
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
    };
}
unfinished!(Median, "median");
unfinished!(TrimmedMean, "trimmed_mean");
unfinished!(Krum, "krum");
unfinished!(MultiKrum, "multi_krum");
