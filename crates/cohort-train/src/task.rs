//! The task seam: what a federation learns, as the loss a client minimises
//! and the metrics evaluation reports.
//!
//! A [`Task`] turns a batch into one target class per output row of the
//! model ([`Task::targets`], told how many rows the model gives a sample:
//! [`crate::model::FederatedModel::rows_per_sample`]) and scores the outputs
//! against them
//! ([`Task::loss`]). Evaluation reports, for any task, the loss and the
//! accuracy (the share of output rows whose top class is the target), both
//! averaged over output rows. cohort ships two tasks:
//!
//! * [`Classification`]: one output row per sample, the sample's label as
//!   its target (images, tabular rows, LEAF's Shakespeare, whose label is the
//!   character after the sequence).
//! * [`NextToken`]: samples are token sequences and the model predicts the
//!   next token. From a model with a row per position
//!   (`[batch × length, vocabulary]` outputs) position `t`'s target is token
//!   `t + 1`, and the last position's is the sample's label; from a model
//!   with a row per sample (LEAF's Shakespeare LSTM) the target is the
//!   label, the token after the sequence.
//!
//! A data set names its task ([`crate::registry::DatasetEntry::with_task`]);
//! classification is the default.

use std::fmt;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};

use cohort_core::data::Dataset;

/// What a federation learns. Implement [`Task::targets`] (and
/// [`Task::loss`] where the loss is not softmax cross-entropy) and register
/// it with a data set.
pub trait Task: Send + Sync + fmt::Debug + 'static {
    /// Shown in the run's banner and errors: `classification`.
    fn name(&self) -> &str;

    /// One target class per row of the model's outputs for the batch of
    /// `labels.len()` samples whose values are `inputs` (each of
    /// `sample_shape`), in the order of the rows; the model gives
    /// `rows_per_sample` rows a sample, a count [`Task::check_rows`] has
    /// accepted.
    fn targets(
        &self,
        inputs: &[f32],
        labels: &[i64],
        sample_shape: &[usize],
        rows_per_sample: usize,
    ) -> Vec<i64>;

    /// The mean loss of `outputs` (`[rows, classes]`) against `targets`
    /// (`[rows]`), a one-element tensor that backpropagates. Softmax
    /// cross-entropy unless a task says otherwise.
    fn loss(&self, outputs: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&outputs.device())
            .forward(outputs, targets)
    }

    /// Why this task cannot take its targets from a model that gives
    /// `rows_per_sample` rows of outputs per sample of `sample_shape`, if it
    /// cannot: one row per sample unless a task says otherwise.
    fn check_rows(&self, rows_per_sample: usize, _sample_shape: &[usize]) -> Result<(), String> {
        if rows_per_sample == 1 {
            Ok(())
        } else {
            Err(format!(
                "{} needs a row of outputs per sample, but the model gives {rows_per_sample}",
                self.name()
            ))
        }
    }

    /// Why `data` cannot be learned as this task by a model with `classes`
    /// outputs, if it cannot. Every label must name a class; a task whose
    /// targets come from the inputs checks those too.
    fn check(&self, data: &Dataset, classes: usize) -> Result<(), String> {
        match data.label_out_of(classes) {
            Some((index, label)) => Err(format!(
                "label {label} at sample {index} is outside 0..{classes}"
            )),
            None => Ok(()),
        }
    }

    /// Whether this is [`Classification`] itself: cohort's own CPU kernels
    /// and the vectorized GPU clients compute its loss and nothing else.
    #[doc(hidden)]
    fn is_builtin_classification(&self) -> bool {
        false
    }
}

/// One class per sample: its label. Loss: softmax cross-entropy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Classification;

impl Task for Classification {
    fn name(&self) -> &str {
        "classification"
    }

    fn targets(
        &self,
        _inputs: &[f32],
        labels: &[i64],
        _sample_shape: &[usize],
        _rows_per_sample: usize,
    ) -> Vec<i64> {
        labels.to_vec()
    }

    fn is_builtin_classification(&self) -> bool {
        true
    }
}

/// Next-token prediction over `[length]` token sequences. A model of
/// `length` rows of logits per sample predicts the token after every
/// position (row `s × length + t` the token after position `t` of sample
/// `s`); a model of one row per sample predicts the token after the
/// sequence, its label. Loss: softmax cross-entropy averaged over the rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct NextToken;

impl Task for NextToken {
    fn name(&self) -> &str {
        "next-token prediction"
    }

    fn targets(
        &self,
        inputs: &[f32],
        labels: &[i64],
        sample_shape: &[usize],
        rows_per_sample: usize,
    ) -> Vec<i64> {
        if rows_per_sample == 1 {
            return labels.to_vec();
        }
        let length: usize = sample_shape.iter().product();
        let mut targets = Vec::with_capacity(inputs.len());
        for (sample, &label) in inputs.chunks_exact(length).zip(labels) {
            // Token ids are exact integers in float32 (checked when loaded).
            targets.extend(sample[1..].iter().map(|&token| token as i64));
            targets.push(label);
        }
        targets
    }

    fn check_rows(&self, rows_per_sample: usize, sample_shape: &[usize]) -> Result<(), String> {
        let length: usize = sample_shape.iter().product();
        if rows_per_sample == 1 || rows_per_sample == length {
            Ok(())
        } else {
            Err(format!(
                "next-token prediction over sequences of {length} tokens needs a row of \
                 outputs per position ({length}) or per sample (1), but the model gives \
                 {rows_per_sample}"
            ))
        }
    }

    fn check(&self, data: &Dataset, classes: usize) -> Result<(), String> {
        if data.sample_shape.len() != 1 {
            return Err(format!(
                "next-token prediction needs samples that are token sequences ([length]), \
                 not {:?}",
                data.sample_shape
            ));
        }
        Classification.check(data, classes)?;
        let bad = data
            .inputs
            .iter()
            .position(|&t| !(t >= 0.0 && t.fract() == 0.0 && (t as usize) < classes));
        match bad {
            Some(at) => Err(format!(
                "token {} at position {} of sample {} is not a token id in 0..{classes}",
                data.inputs[at],
                at % data.values_per_sample(),
                at / data.values_per_sample()
            )),
            None => Ok(()),
        }
    }
}

/// A loss and accuracy summed over output rows, finished into means.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Score {
    pub loss_sum: f64,
    pub correct: u64,
    pub rows: u64,
}

impl Score {
    pub fn add(&mut self, other: Score) {
        self.loss_sum += other.loss_sum;
        self.correct += other.correct;
        self.rows += other.rows;
    }

    pub fn finish(self) -> Evaluation {
        let rows = self.rows.max(1) as f64;
        Evaluation {
            accuracy: self.correct as f64 / rows,
            loss: self.loss_sum / rows,
            rows: self.rows,
        }
    }
}

/// What evaluation reports for any task: means over the output rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// Share of rows whose top class (the first, on a tie) is the target.
    pub accuracy: f64,
    /// The task's loss, averaged over rows.
    pub loss: f64,
    /// Output rows scored (samples, or samples × length).
    pub rows: u64,
}

/// Softmax cross-entropy of one row of logits against `target`, in f64 (the
/// native kernels' evaluation, which has logits on the host).
pub(crate) fn cross_entropy_of_row(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - logits[target] as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_token_targets_are_the_sequence_shifted_by_one_then_the_label() {
        let inputs = [1.0, 2.0, 3.0, 7.0, 8.0, 9.0];
        let targets = NextToken.targets(&inputs, &[4, 0], &[3], 3);
        assert_eq!(targets, vec![2, 3, 4, 8, 9, 0]);
    }

    #[test]
    fn next_token_from_a_row_per_sample_is_the_token_after_the_sequence() {
        let inputs = [1.0, 2.0, 3.0, 7.0, 8.0, 9.0];
        assert_eq!(NextToken.targets(&inputs, &[4, 0], &[3], 1), vec![4, 0]);
        assert_eq!(NextToken.check_rows(1, &[3]), Ok(()));
        assert_eq!(NextToken.check_rows(3, &[3]), Ok(()));
        let error = NextToken.check_rows(2, &[3]).unwrap_err();
        assert!(
            error.contains("per position (3) or per sample (1)"),
            "{error}"
        );
        assert!(error.contains("gives 2"), "{error}");
    }

    #[test]
    fn classification_needs_a_row_per_sample() {
        assert_eq!(Classification.check_rows(1, &[1, 28, 28]), Ok(()));
        let error = Classification.check_rows(80, &[80]).unwrap_err();
        assert!(
            error.contains("classification needs a row of outputs per sample"),
            "{error}"
        );
    }

    #[test]
    fn next_token_refuses_inputs_that_are_not_token_ids() {
        let data = Dataset::new(vec![0.0, 1.5, 2.0, 3.0], vec![1, 2], vec![2]).unwrap();
        let error = NextToken.check(&data, 4).unwrap_err();
        assert!(
            error.contains("token 1.5 at position 1 of sample 0"),
            "{error}"
        );
        let data = Dataset::new(vec![0.0, 1.0, 2.0, 4.0], vec![1, 2], vec![2]).unwrap();
        let error = NextToken.check(&data, 4).unwrap_err();
        assert!(
            error.contains("token 4 at position 1 of sample 1"),
            "{error}"
        );
        let images = Dataset::new(vec![0.0; 4], vec![0], vec![1, 2, 2]).unwrap();
        assert!(
            NextToken
                .check(&images, 4)
                .unwrap_err()
                .contains("[1, 2, 2]")
        );
    }

    #[test]
    fn a_score_averages_over_rows() {
        let mut score = Score::default();
        score.add(Score {
            loss_sum: 3.0,
            correct: 1,
            rows: 2,
        });
        score.add(Score {
            loss_sum: 1.0,
            correct: 2,
            rows: 2,
        });
        let evaluation = score.finish();
        assert_eq!((evaluation.accuracy, evaluation.loss), (0.75, 1.0));
    }

    #[test]
    fn cross_entropy_of_a_row_is_by_hand() {
        // log(e^0 + e^ln3) - 0 = ln 4 for target 0 of logits [0, ln 3].
        let loss = cross_entropy_of_row(&[0.0, 3f32.ln()], 0);
        assert!((loss - 4f64.ln()).abs() < 1e-6, "{loss}");
    }
}
