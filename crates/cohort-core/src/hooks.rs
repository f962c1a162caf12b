//! Server hooks between receipt and aggregation, and their positional contract.
//!
//! Extensions see a round's payloads after they arrive and before FedAvg runs:
//! [`ServerHooks::weights_received`] may replace trees,
//! [`ServerHooks::on_weights_received`] observes them, and
//! [`ServerHooks::on_reports_received`] is the client-selection hook.
//!
//! **The contract:** after the hooks, the item at index *i* must still belong to
//! the report and logical client at index *i*. Rust's types enforce what they
//! can: every payload carries a [`Provenance`] token that only the server can
//! create (its fields are private and it has no public constructor), and a
//! replacement tree is attached *through* the original payload
//! ([`ReceivedPayload::replace_tree`]), which keeps its token. What types cannot
//! prevent — reordering, dropping or duplicating payloads in the vector, editing
//! a report's client id, a tree of another shape — [`validate_after_hooks`]
//! detects, and the round stops before aggregation with a [`HookViolation`].
//!
//! **What the contract cannot prove:** a replacement tree with the same schema
//! might belong to another client; only its author knows. Same-schema
//! replacements are the hook author's responsibility. Side effects a hook
//! performs (files, counters, network calls) are not rolled back when
//! validation fails.

use crate::tree::{DTypeRule, ParamTree, SchemaMismatch, check_schema};

/// What a client reports beside its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientReport {
    pub client_id: u32,
    pub num_samples: u64,
    /// Mean training loss.
    pub loss: f64,
    pub training_time: f64,
    /// Local optimizer steps taken.
    pub local_steps: u64,
    /// Index of the physical worker that trained it.
    pub worker: usize,
}

/// Where a payload came from: its round, its position in the round's selection
/// and its client. Only the server creates these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    round: u32,
    slot: usize,
    client_id: u32,
}

/// A client's report and weights as received, with their provenance.
#[derive(Debug, Clone)]
pub struct ReceivedPayload {
    provenance: Provenance,
    /// Hooks may adjust the report; its client id must not change.
    pub report: ClientReport,
    tree: ParamTree,
}

impl ReceivedPayload {
    /// Server side only: wraps what arrived for `slot` of `round`.
    pub(crate) fn new(round: u32, slot: usize, report: ClientReport, tree: ParamTree) -> Self {
        Self {
            provenance: Provenance {
                round,
                slot,
                client_id: report.client_id,
            },
            report,
            tree,
        }
    }

    pub fn tree(&self) -> &ParamTree {
        &self.tree
    }

    /// Replaces the weights, keeping this payload's provenance: the new tree
    /// stays attached to the same client and report.
    pub fn replace_tree(&mut self, tree: ParamTree) {
        self.tree = tree;
    }

    pub fn provenance(&self) -> &Provenance {
        &self.provenance
    }

    pub fn into_parts(self) -> (ClientReport, ParamTree) {
        (self.report, self.tree)
    }
}

/// The payloads of one round, in selection order, as the server assembles them.
#[derive(Debug)]
pub struct RoundPayloads {
    round: u32,
    client_ids: Vec<u32>,
    payloads: Vec<ReceivedPayload>,
}

impl RoundPayloads {
    /// `arrived` holds `(slot, report, tree)` in any order; each slot of
    /// `selected` must appear exactly once.
    pub fn assemble(
        round: u32,
        selected: &[u32],
        arrived: Vec<(usize, ClientReport, ParamTree)>,
    ) -> Result<Self, HookViolation> {
        let mut slots: Vec<Option<ReceivedPayload>> = (0..selected.len()).map(|_| None).collect();
        for (slot, report, tree) in arrived {
            let expected = selected.get(slot).copied();
            if expected != Some(report.client_id) || slots[slot].is_some() {
                return Err(HookViolation {
                    hook: "receipt",
                    index: slot,
                    problem: format!(
                        "payload from client {} does not fit slot {slot} (expected client {expected:?})",
                        report.client_id
                    ),
                });
            }
            slots[slot] = Some(ReceivedPayload::new(round, slot, report, tree));
        }
        let payloads = slots
            .into_iter()
            .enumerate()
            .map(|(slot, p)| {
                p.ok_or_else(|| HookViolation {
                    hook: "receipt",
                    index: slot,
                    problem: format!("no payload arrived from client {}", selected[slot]),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            round,
            client_ids: selected.to_vec(),
            payloads,
        })
    }

    pub fn payloads(&self) -> &[ReceivedPayload] {
        &self.payloads
    }

    /// Runs the three hooks in order, validating after each, so a violation
    /// names the hook that caused it.
    pub fn apply_hooks(
        mut self,
        hooks: &mut dyn ServerHooks,
        global: &ParamTree,
    ) -> Result<Self, HookViolation> {
        self.payloads = hooks.weights_received(self.payloads);
        validate_after_hooks(
            "weights_received",
            self.round,
            &self.client_ids,
            &self.payloads,
            global,
        )?;
        hooks.on_weights_received(&self.payloads);
        self.payloads = hooks.on_reports_received(self.payloads);
        validate_after_hooks(
            "on_reports_received",
            self.round,
            &self.client_ids,
            &self.payloads,
            global,
        )?;
        Ok(self)
    }

    pub fn into_payloads(self) -> Vec<ReceivedPayload> {
        self.payloads
    }
}

/// Extension points between receipt and aggregation. Every method has a
/// do-nothing default.
pub trait ServerHooks {
    /// Whether these hooks leave every payload as it is and observe nothing,
    /// so a round may be aggregated without ever holding all its payloads in
    /// one place (`cluster.reduce = partial`). Only [`NoHooks`] says yes.
    fn passes_through(&self) -> bool {
        false
    }

    /// May replace trees (through [`ReceivedPayload::replace_tree`]); must
    /// return every payload at its index.
    fn weights_received(&mut self, payloads: Vec<ReceivedPayload>) -> Vec<ReceivedPayload> {
        payloads
    }

    /// Observes the payloads after `weights_received`.
    fn on_weights_received(&mut self, _payloads: &[ReceivedPayload]) {}

    /// The client-selection hook: sees the reports, may adjust them, must
    /// return every payload at its index.
    fn on_reports_received(&mut self, payloads: Vec<ReceivedPayload>) -> Vec<ReceivedPayload> {
        payloads
    }
}

/// Hooks that do nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHooks;

impl ServerHooks for NoHooks {
    fn passes_through(&self) -> bool {
        true
    }
}

/// A hook broke the positional contract or the schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("after hook `{hook}`, item {index}: {problem}; the round stops before aggregation")]
pub struct HookViolation {
    pub hook: &'static str,
    pub index: usize,
    pub problem: String,
}

/// Checks that `payloads` are exactly the round's payloads, each at its index,
/// with unchanged client ids and trees of the global model's schema.
pub fn validate_after_hooks(
    hook: &'static str,
    round: u32,
    client_ids: &[u32],
    payloads: &[ReceivedPayload],
    global: &ParamTree,
) -> Result<(), HookViolation> {
    let violation = |index: usize, problem: String| HookViolation {
        hook,
        index,
        problem,
    };
    if payloads.len() != client_ids.len() {
        return Err(violation(
            payloads.len().min(client_ids.len()),
            format!(
                "{} payloads came back for {} clients (payloads were dropped or duplicated)",
                payloads.len(),
                client_ids.len()
            ),
        ));
    }
    for (index, (payload, &client_id)) in payloads.iter().zip(client_ids).enumerate() {
        let provenance = &payload.provenance;
        if provenance.round != round {
            return Err(violation(
                index,
                format!("payload of round {} in round {round}", provenance.round),
            ));
        }
        if provenance.slot != index {
            let duplicated = payloads
                .iter()
                .filter(|p| p.provenance.slot == provenance.slot)
                .count()
                > 1;
            return Err(violation(
                index,
                format!(
                    "holds the payload of index {} (client {}): payloads were {}",
                    provenance.slot,
                    provenance.client_id,
                    if duplicated {
                        "duplicated"
                    } else {
                        "reordered"
                    }
                ),
            ));
        }
        if payload.report.client_id != client_id || provenance.client_id != client_id {
            return Err(violation(
                index,
                format!(
                    "report says client {}, but this payload came from client {client_id}",
                    payload.report.client_id
                ),
            ));
        }
        check_schema(global, &payload.tree, DTypeRule::AnyFloat).map_err(
            |mismatch: SchemaMismatch| {
                violation(
                    index,
                    format!("client {client_id}: tree does not match the global model: {mismatch}"),
                )
            },
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Array;

    fn tree(value: f32) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![2], vec![value, value]).unwrap(),
        )])
    }

    fn report(client_id: u32) -> ClientReport {
        ClientReport {
            client_id,
            num_samples: 10,
            loss: 0.0,
            training_time: 0.0,
            local_steps: 1,
            worker: 0,
        }
    }

    fn round() -> RoundPayloads {
        RoundPayloads::assemble(
            3,
            &[7, 2, 5],
            // Arrival order differs from selection order.
            vec![
                (2, report(5), tree(5.0)),
                (0, report(7), tree(7.0)),
                (1, report(2), tree(2.0)),
            ],
        )
        .unwrap()
    }

    struct Hook<F: FnMut(Vec<ReceivedPayload>) -> Vec<ReceivedPayload>>(F);

    impl<F: FnMut(Vec<ReceivedPayload>) -> Vec<ReceivedPayload>> ServerHooks for Hook<F> {
        fn weights_received(&mut self, payloads: Vec<ReceivedPayload>) -> Vec<ReceivedPayload> {
            (self.0)(payloads)
        }
    }

    fn apply(
        f: impl FnMut(Vec<ReceivedPayload>) -> Vec<ReceivedPayload>,
    ) -> Result<Vec<u32>, HookViolation> {
        let global = tree(0.0);
        round().apply_hooks(&mut Hook(f), &global).map(|r| {
            r.into_payloads()
                .iter()
                .map(|p| p.report.client_id)
                .collect()
        })
    }

    #[test]
    fn assembly_restores_selection_order() {
        let ids: Vec<u32> = round()
            .payloads()
            .iter()
            .map(|p| p.report.client_id)
            .collect();
        assert_eq!(ids, [7, 2, 5]);
    }

    #[test]
    fn identity_and_same_schema_replacement_pass() {
        assert_eq!(apply(|p| p).unwrap(), [7, 2, 5]);
        let replaced = apply(|mut p| {
            p[1].replace_tree(tree(100.0));
            p
        });
        assert_eq!(replaced.unwrap(), [7, 2, 5]);
    }

    #[test]
    fn reordering_is_refused() {
        let error = apply(|mut p| {
            p.swap(0, 1);
            p
        })
        .unwrap_err();
        assert_eq!(error.hook, "weights_received");
        assert!(error.problem.contains("reordered"), "{error}");
    }

    #[test]
    fn dropping_is_refused() {
        let error = apply(|mut p| {
            p.pop();
            p
        })
        .unwrap_err();
        assert!(
            error.problem.contains("2 payloads came back for 3 clients"),
            "{error}"
        );
    }

    #[test]
    fn duplicating_is_refused() {
        let error = apply(|mut p| {
            p[2] = p[0].clone();
            p
        })
        .unwrap_err();
        assert!(error.problem.contains("duplicated"), "{error}");
        let error = apply(|mut p| {
            let copy = p[0].clone();
            p.push(copy);
            p
        })
        .unwrap_err();
        assert!(error.problem.contains("4 payloads came back"), "{error}");
    }

    #[test]
    fn client_id_change_is_refused() {
        let error = apply(|mut p| {
            p[1].report.client_id = 9;
            p
        })
        .unwrap_err();
        assert!(error.problem.contains("report says client 9"), "{error}");
    }

    #[test]
    fn wrong_schema_replacement_is_refused() {
        let error = apply(|mut p| {
            p[0].replace_tree(ParamTree::from_dotted([(
                "w".to_owned(),
                Array::f32(vec![3], vec![0.0; 3]).unwrap(),
            )]));
            p
        })
        .unwrap_err();
        assert!(
            error.problem.contains("expected shape [2], found [3]"),
            "{error}"
        );
    }

    #[test]
    fn selection_hook_is_validated_too() {
        struct Reorders;
        impl ServerHooks for Reorders {
            fn on_reports_received(
                &mut self,
                mut payloads: Vec<ReceivedPayload>,
            ) -> Vec<ReceivedPayload> {
                payloads.reverse();
                payloads
            }
        }
        let error = round().apply_hooks(&mut Reorders, &tree(0.0)).unwrap_err();
        assert_eq!(error.hook, "on_reports_received");
    }

    #[test]
    fn a_payload_for_the_wrong_slot_is_refused_at_receipt() {
        let error = RoundPayloads::assemble(
            1,
            &[1, 2],
            vec![(0, report(2), tree(0.0)), (1, report(2), tree(0.0))],
        )
        .unwrap_err();
        assert_eq!(error.hook, "receipt");
    }
}
