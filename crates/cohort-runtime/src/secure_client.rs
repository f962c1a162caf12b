//! The client process's side of secure aggregation (network mode): after a
//! task trains, its update stays here. The process masks `[w, w·(x − g)]`
//! (`cohort_core::secagg::masked_change`, the vector simulation mode masks),
//! or with `secure_aggregation.noise` its change clipped, rotated, rounded
//! and noised (`cohort_core::secagg::ddg_masked_input`), the noise drawn
//! here from the operating system so that the server cannot remove it,
//! and answers the server's stage messages through one
//! [`ClientRound`] per logical client and round, so the server only ever
//! receives keys, sealed shares, a masked vector and the shares it may have.
//!
//! A hidden `cohort client --secagg-fault` makes a real process misbehave at
//! one stage, for tests of the server's handling: leave (the process exits)
//! or send a rogue message.

use std::collections::BTreeMap;
use std::str::FromStr;

use cohort_core::config::LoadedConfig;
use cohort_core::secagg::network::{ClientRound, PartyRng, fresh_rng, stage_name};
use cohort_core::secagg::sim::Stage;
use cohort_core::secagg::wire::{Limits, MaskedInput, Message, SealedShares};
use cohort_core::secagg::{DdgParams, Params, ddg, ddg_masked_input, masked_change, resolve_ddg};
use cohort_core::strategy::ClientUpdate;

use crate::client::ClientReply;

/// A misbehaviour for tests (`cohort client --secagg-fault`, hidden).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecAggFault {
    /// The process exits when the server's message for this stage arrives,
    /// without answering it.
    LeaveAt(Stage),
    /// The process stays connected but never answers this stage's message,
    /// so the server's stage deadline is what ends its part.
    StallAt(Stage),
    /// Sealed shares cut short.
    MalformedShares,
    /// One more sealed share, for a client that is no neighbour.
    StrangerShare,
    /// A masked vector one value short.
    ShortInput,
}

impl FromStr for SecAggFault {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Ok(match text {
            "leave-at-share-keys" => Self::LeaveAt(Stage::ShareKeys),
            "leave-at-masked-input" => Self::LeaveAt(Stage::MaskedInput),
            "leave-at-unmask" => Self::LeaveAt(Stage::Unmask),
            "stall-at-masked-input" => Self::StallAt(Stage::MaskedInput),
            "stall-at-unmask" => Self::StallAt(Stage::Unmask),
            "malformed-shares" => Self::MalformedShares,
            "stranger-share" => Self::StrangerShare,
            "short-input" => Self::ShortInput,
            other => {
                return Err(format!(
                    "unknown fault `{other}`; expected leave-at-share-keys, \
                     leave-at-masked-input, leave-at-unmask, stall-at-masked-input, \
                     stall-at-unmask, malformed-shares, stranger-share or short-input"
                ));
            }
        })
    }
}

/// What to do with a stage message.
pub(crate) enum Reply {
    Answer(Vec<u8>),
    Refuse(String),
    /// Nothing at all (`--secagg-fault stall-at-…`).
    Silent,
}

/// The process's parts, one per logical client of the rounds in flight.
pub(crate) struct SecureClient {
    expected: Params,
    max_clients: u32,
    parts: BTreeMap<(u32, u32), ClientRound>,
    rng: PartyRng,
    fault: Option<SecAggFault>,
    loaded: LoadedConfig,
    /// The noise to add before masking, and the run's seed its rotation
    /// comes from.
    noise: Option<(DdgParams, u64)>,
}

impl SecureClient {
    /// The client side when the server's config asks for secure
    /// aggregation; `None` otherwise.
    pub(crate) fn of_config(
        loaded: &LoadedConfig,
        fault: Option<SecAggFault>,
    ) -> anyhow::Result<Option<Self>> {
        let config = loaded.config();
        let Some(secure) = &config.secure_aggregation else {
            return Ok(None);
        };
        let per_round = config.clients.per_round;
        let expected = secure
            .params_for(per_round as usize)
            .map_err(|e| anyhow::anyhow!("the server's config: {e}"))?;
        let noise = secure
            .ddg_params(per_round as usize)
            .map_err(|e| anyhow::anyhow!("the server's config: {e}"))?
            .map(|params| (params, config.server.random_seed));
        Ok(Some(Self {
            expected,
            // A round draws at most every client (more than per_round with
            // clients.over_selection).
            max_clients: config.clients.total_clients,
            parts: BTreeMap::new(),
            rng: fresh_rng(),
            fault,
            loaded: loaded.clone(),
            noise,
        }))
    }

    /// Keeps a trained task's update for the protocol: its change from the
    /// global model, with its sample count as the weight. Parts of
    /// earlier rounds are over by now and are forgotten.
    pub(crate) fn trained(
        &mut self,
        client_id: u32,
        round: u32,
        global_payload: &[u8],
        reply: &ClientReply,
    ) -> Result<(), String> {
        self.parts.retain(|&(r, _), _| r >= round);
        let pipelines = self.loaded.pipelines();
        let limits = self.loaded.decode_limits();
        let global = pipelines
            .client_inbound
            .receive(global_payload, &limits)
            .map_err(|e| format!("cannot unpack the global model to mask against: {e}"))?;
        // The update as the server would unpack it in the clear, so both
        // modes mask the same values.
        let tree = pipelines
            .server_inbound
            .receive(&reply.payload, &limits)
            .map_err(|e| format!("cannot unpack its own update to mask it: {e}"))?;
        let update = ClientUpdate {
            client_id,
            num_samples: reply.num_samples,
            local_steps: reply.local_steps,
            tree: &tree,
        };
        let (id, expected) = (u64::from(client_id), self.expected.clone());
        let part = match &self.noise {
            Some((noise, run_seed)) => {
                let mechanism = resolve_ddg(noise, &self.expected, &global)
                    .map_err(|e| format!("cannot set up its noise: {e}"))?;
                let rotation = ddg::rotation_seed(*run_seed, round);
                let values =
                    ddg_masked_input(&mechanism, &global, &update, rotation, &mut self.rng)?;
                ClientRound::encoded(id, expected, self.max_clients, values)
            }
            None => {
                let change = masked_change(&global, &update)?;
                let weight = reply.num_samples as f64;
                ClientRound::new(id, expected, self.max_clients, weight, change)
            }
        };
        self.parts.insert((round, client_id), part);
        Ok(())
    }

    /// The answer to one stage message for `client_id` in `round`.
    pub(crate) fn answer(
        &mut self,
        round: u32,
        client_id: u32,
        stage: Stage,
        body: &[u8],
    ) -> Reply {
        if self.fault == Some(SecAggFault::LeaveAt(stage)) {
            tracing::warn!(
                round,
                client = client_id,
                "--secagg-fault: leaving at {} as asked",
                stage_name(stage)
            );
            std::process::exit(3);
        }
        if self.fault == Some(SecAggFault::StallAt(stage)) {
            tracing::warn!(
                round,
                client = client_id,
                "--secagg-fault: not answering {} as asked",
                stage_name(stage)
            );
            return Reply::Silent;
        }
        let Some(part) = self.parts.get_mut(&(round, client_id)) else {
            return Reply::Refuse(format!(
                "this process holds no trained update of client {client_id} in round {round}"
            ));
        };
        let answer = part.answer(stage, body, &mut self.rng);
        if part.is_done() {
            self.parts.remove(&(round, client_id));
        }
        match answer {
            Ok(bytes) => Reply::Answer(self.tampered(stage, bytes)),
            Err(error) => {
                tracing::warn!(round, client = client_id, "secure aggregation: {error}");
                Reply::Refuse(error.to_string())
            }
        }
    }

    /// `bytes` as the fault makes them (unchanged without one).
    fn tampered(&self, stage: Stage, bytes: Vec<u8>) -> Vec<u8> {
        let limits = Limits {
            max_peers: usize::MAX,
            max_values: usize::MAX,
        };
        match (self.fault, stage) {
            (Some(SecAggFault::MalformedShares), Stage::ShareKeys) => {
                let Ok(mut shares) = SealedShares::from_bytes(&bytes, &limits) else {
                    return bytes;
                };
                shares.entries.iter_mut().for_each(|(_, s)| s.truncate(8));
                shares.to_bytes()
            }
            (Some(SecAggFault::StrangerShare), Stage::ShareKeys) => {
                let Ok(mut shares) = SealedShares::from_bytes(&bytes, &limits) else {
                    return bytes;
                };
                if let Some((_, sealed)) = shares.entries.first().cloned() {
                    shares.entries.push((u64::from(u32::MAX), sealed));
                }
                shares.to_bytes()
            }
            (Some(SecAggFault::ShortInput), Stage::MaskedInput) => {
                let Ok(mut input) = MaskedInput::from_bytes(&bytes, &limits) else {
                    return bytes;
                };
                input.values.pop();
                input.to_bytes()
            }
            _ => bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_named_as_the_flag_takes_them() {
        assert_eq!(
            "leave-at-masked-input".parse(),
            Ok(SecAggFault::LeaveAt(Stage::MaskedInput))
        );
        assert_eq!("short-input".parse(), Ok(SecAggFault::ShortInput));
        let error = "leave".parse::<SecAggFault>().unwrap_err();
        assert!(error.contains("leave-at-unmask"), "{error}");
    }
}
