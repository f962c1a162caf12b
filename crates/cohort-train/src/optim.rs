//! Optimizers with MLX's update rules, as burn [`Optimizer`]s.
//!
//! burn's own optimizers differ from MLX in defaults (Adam eps 1e-5, SGD
//! dampening 0.1) and in rules (burn's Adam always corrects bias; MLX's does
//! only when asked). The seed specifies MLX, so the rules are written out here,
//! one per optimizer, each following MLX 0.32's `apply_single`. State starts at
//! zero as in MLX, and an optimizer is created fresh for every local run.
//!
//! On burn's CPU device SGD and Adam take their steps on the host instead
//! (`HostOptimizer`), with the same bits.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{
    GradientsParams, LearningRate, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource,
};
use burn::tensor::{DType, Device, Tensor, TensorData};
use cohort_core::optim::OptimizerSpec;

/// Builds the optimizer a local training run uses.
pub fn build(spec: &OptimizerSpec) -> ModuleOptimizer {
    match *spec {
        OptimizerSpec::Sgd { .. } => {
            ModuleOptimizer::from(sgd_rule(spec).expect("an SGD spec has an SGD rule"))
        }
        OptimizerSpec::Adam { .. } | OptimizerSpec::AdamW { .. } => {
            ModuleOptimizer::from(adam_rule(spec).expect("an Adam spec has an Adam rule"))
        }
        OptimizerSpec::RmsProp { alpha, eps, .. } => ModuleOptimizer::from(MlxRmsProp {
            alpha: alpha as f32,
            eps: eps as f32,
        }),
        OptimizerSpec::Lion {
            betas,
            weight_decay,
            ..
        } => ModuleOptimizer::from(MlxLion {
            betas: [betas[0] as f32, betas[1] as f32],
            weight_decay: weight_decay as f32,
        }),
    }
}

/// One moment buffer.
#[derive(Clone)]
pub struct MomentState<const D: usize> {
    pub moment: Tensor<D>,
}

/// First and second moments with the step count.
#[derive(Clone)]
pub struct AdamState<const D: usize> {
    pub step: usize,
    pub m: Tensor<D>,
    pub v: Tensor<D>,
}

// burn's `RecordState` derive only works inside burn-optim, so the two states
// spell out their (de)serialization. cohort recreates optimizers for every local
// run, but a recordable state keeps them usable with burn's checkpointing.
impl<const D: usize> RecordState for MomentState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_tensor(prefix, "moment", self.moment.to_data());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        Some(Self {
            moment: Tensor::from_data(src.take_tensor(prefix, "moment")?, device),
        })
    }
}

impl<const D: usize> RecordState for AdamState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_tensor(prefix, "step", TensorData::new(vec![self.step as i64], [1]));
        out.push_tensor(prefix, "m", self.m.to_data());
        out.push_tensor(prefix, "v", self.v.to_data());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let step = src
            .take_tensor(prefix, "step")?
            .try_to_vec::<i64>()
            .ok()?
            .first()
            .copied()?;
        Some(Self {
            step: usize::try_from(step).ok()?,
            m: Tensor::from_data(src.take_tensor(prefix, "m")?, device),
            v: Tensor::from_data(src.take_tensor(prefix, "v")?, device),
        })
    }
}

/// MLX `SGD`: `g += wd·p`; `v = μ·v + (1 − dampening)·g`; update `g + μ·v`
/// (Nesterov) or `v`.
#[derive(Clone, Debug)]
pub struct MlxSgd {
    momentum: f32,
    weight_decay: f32,
    dampening: f32,
    nesterov: bool,
}

/// The rule of an SGD spec, for burn's optimizer ([`build`]) or for a run
/// that keeps its parameters on the host (`crate::kernels::Native`);
/// `None` for the other optimizers.
pub(crate) fn sgd_rule(spec: &OptimizerSpec) -> Option<MlxSgd> {
    match *spec {
        OptimizerSpec::Sgd {
            momentum,
            weight_decay,
            dampening,
            nesterov,
            ..
        } => Some(MlxSgd {
            momentum: momentum as f32,
            weight_decay: weight_decay as f32,
            dampening: dampening as f32,
            nesterov,
        }),
        _ => None,
    }
}

/// The rule of an Adam or AdamW spec (AdamW's decay, none for Adam), for
/// burn's optimizer ([`build`]) or for steps on the host ([`HostOptimizer`]);
/// `None` for the other optimizers.
pub(crate) fn adam_rule(spec: &OptimizerSpec) -> Option<MlxAdam> {
    let (betas, eps, weight_decay, bias_correction) = match *spec {
        OptimizerSpec::Adam {
            betas,
            eps,
            bias_correction,
            ..
        } => (betas, eps, 0.0, bias_correction),
        OptimizerSpec::AdamW {
            betas,
            eps,
            weight_decay,
            bias_correction,
            ..
        } => (betas, eps, weight_decay, bias_correction),
        _ => return None,
    };
    Some(MlxAdam {
        betas: [betas[0] as f32, betas[1] as f32],
        eps: eps as f32,
        weight_decay: weight_decay as f32,
        bias_correction,
    })
}

impl MlxSgd {
    /// One step of the rule on host values: `param` updated in place,
    /// `velocity` the moment (empty before the first step). The tensor
    /// version's operations in the same order, each rounded to float32, so
    /// the same bits (`the_host_rule_is_the_tensor_rule_bit_for_bit`).
    pub(crate) fn step_host(
        &self,
        lr: f64,
        param: &mut [f32],
        grad: &[f32],
        velocity: &mut Vec<f32>,
    ) {
        assert_eq!(param.len(), grad.len(), "a gradient per parameter");
        let lr = lr as f32;
        let decay = self.weight_decay;
        if self.momentum <= 0.0 {
            for (p, &g) in param.iter_mut().zip(grad) {
                *p -= decayed(*p, g, decay) * lr;
            }
            return;
        }
        let (momentum, nesterov) = (self.momentum, self.nesterov);
        let (dampened, damping) = (self.dampening > 0.0, 1.0 - self.dampening);
        let first = velocity.is_empty();
        if first {
            velocity.resize(param.len(), 0.0);
        }
        assert_eq!(velocity.len(), param.len(), "a moment per parameter");
        let values = param.iter_mut().zip(grad).zip(velocity.iter_mut());
        for ((p, &g), v) in values {
            let g = decayed(*p, g, decay);
            let scaled = if dampened { g * damping } else { g };
            let next = if first {
                scaled
            } else {
                *v * momentum + scaled
            };
            *v = next;
            let update = if nesterov { g + next * momentum } else { next };
            *p -= update * lr;
        }
    }
}

/// SGD or Adam for a model on burn's CPU device, their moments kept on the
/// host for the whole local run. Each step takes a parameter's values out
/// of their tensor (without a copy where the module holds the tensor
/// alone), updates them in one pass ([`MlxSgd::step_host`],
/// [`MlxAdam::step_host`]) and puts them back. burn's optimizer spends four
/// to ten tensor operations on a parameter, each a pass over it and most an
/// allocation: 29 % of `multilayer`'s step on the CPU with SGD. The same
/// bits as burn's optimizer with the same rule
/// (`host_steps_are_the_burn_optimizers_bit_for_bit` in the trainer). Off
/// where the native kernels are turned off (`COHORT_NATIVE_KERNELS=0`), so
/// that a run can be compared with burn's own path.
pub(crate) struct HostOptimizer {
    rule: HostRule,
    /// Each parameter's state, in the module's parameter order.
    moments: Vec<HostMoments>,
}

/// The rules [`HostOptimizer`] runs.
enum HostRule {
    Sgd(MlxSgd),
    Adam(MlxAdam),
}

/// One parameter's optimizer state on the host: SGD's velocity in `first`;
/// Adam's moments in `first` and `second`, with its step count. Empty
/// before the parameter's first step.
#[derive(Default)]
struct HostMoments {
    first: Vec<f32>,
    second: Vec<f32>,
    steps: usize,
}

impl HostOptimizer {
    /// The host steps for `model` under `spec`: `None` unless the optimizer
    /// is SGD, Adam or AdamW and every parameter is a float32 tensor on
    /// burn's CPU device.
    pub(crate) fn for_model<M: Module>(spec: &OptimizerSpec, model: &M) -> Option<Self> {
        let mut check = HostFloats { all: true };
        model.visit(&mut check);
        check.all.then(|| Self::for_spec(spec)).flatten()
    }

    /// The host rule of `spec` (SGD, Adam or AdamW; otherwise `None`), for
    /// parameters that already live on the host: the native kernels' whole
    /// local run ([`crate::kernels`]), which calls [`HostOptimizer::update`]
    /// itself.
    pub(crate) fn for_spec(spec: &OptimizerSpec) -> Option<Self> {
        let rule = match sgd_rule(spec) {
            Some(sgd) => HostRule::Sgd(sgd),
            None => HostRule::Adam(adam_rule(spec)?),
        };
        Some(Self {
            rule,
            moments: Vec::new(),
        })
    }

    /// `model` after one step on `grads` at `learning_rate`.
    pub(crate) fn step<M: Module>(
        &mut self,
        learning_rate: f64,
        model: M,
        grads: GradientsParams,
    ) -> M {
        model.map(&mut HostStep {
            optimizer: self,
            learning_rate,
            grads,
            next: 0,
        })
    }

    /// One step of the rule on the values of parameter number `slot` (in
    /// the module's parameter order), whose moments this optimizer keeps
    /// from the slot's first step to the end of the local run.
    pub(crate) fn update(
        &mut self,
        slot: usize,
        learning_rate: f64,
        param: &mut [f32],
        grad: &[f32],
    ) {
        if self.moments.len() <= slot {
            self.moments.resize_with(slot + 1, HostMoments::default);
        }
        let state = &mut self.moments[slot];
        match &self.rule {
            HostRule::Sgd(sgd) => sgd.step_host(learning_rate, param, grad, &mut state.first),
            HostRule::Adam(adam) => adam.step_host(learning_rate, param, grad, state),
        }
    }
}

/// Whether every parameter a module visits is float32 on burn's CPU device.
struct HostFloats {
    all: bool,
}

impl ModuleVisitor for HostFloats {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        self.all &= value.dtype() == DType::F32 && crate::kernels::enabled_on(&value.device());
    }
}

struct HostStep<'a> {
    optimizer: &'a mut HostOptimizer,
    learning_rate: f64,
    grads: GradientsParams,
    next: usize,
}

impl ModuleMapper for HostStep<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let slot = self.next;
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let inner = tensor.inner();
        let (shape, device) = (inner.dims().to_vec(), inner.device());
        let mut values = inner
            .into_data()
            .try_into_vec::<f32>()
            .expect("HostOptimizer::for_model admits float32 parameters only");
        let grad = grad.into_data();
        let grad = grad
            .as_slice::<f32>()
            .expect("float32 parameters have float32 gradients");
        self.optimizer
            .update(slot, self.learning_rate, &mut values, grad);
        let updated = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
        let updated = Tensor::from_inner(updated);
        let updated = if require_grad {
            updated.require_grad()
        } else {
            updated
        };
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// SGD's gradient with weight decay `decay` added, as the tensor rule adds
/// it: not at all where `decay` is zero.
#[inline(always)]
fn decayed(p: f32, g: f32, decay: f32) -> f32 {
    if decay != 0.0 { g + p * decay } else { g }
}

impl Optimizer for MlxSgd {
    type State<const D: usize> = MomentState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let lr = lr as f32;
        let grad = if self.weight_decay != 0.0 {
            grad + tensor.clone().mul_scalar(self.weight_decay)
        } else {
            grad
        };
        if self.momentum <= 0.0 {
            return (tensor - grad.mul_scalar(lr), None);
        }
        let scaled_grad = if self.dampening > 0.0 {
            grad.clone().mul_scalar(1.0 - self.dampening)
        } else {
            grad.clone()
        };
        // MLX starts the velocity at zero, so the first step is the (damped) gradient.
        let velocity = match state {
            Some(state) => state.moment.mul_scalar(self.momentum) + scaled_grad,
            None => scaled_grad,
        };
        let update = if self.nesterov {
            grad + velocity.clone().mul_scalar(self.momentum)
        } else {
            velocity.clone()
        };
        (
            tensor - update.mul_scalar(lr),
            Some(MomentState { moment: velocity }),
        )
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        MomentState {
            moment: state.moment.to_device(device),
        }
    }
}

/// MLX `Adam` and `AdamW` (`weight_decay > 0` decays `p ← p·(1 − lr·wd)` first).
/// Without bias correction (MLX's default): `p −= lr·m / (√v + eps)`.
#[derive(Clone, Debug)]
pub struct MlxAdam {
    betas: [f32; 2],
    eps: f32,
    weight_decay: f32,
    bias_correction: bool,
}

impl MlxAdam {
    /// One step of the rule on host values: `param` updated in place, the
    /// moments and step count in `state` (empty before the first step). The
    /// tensor version's operations in the same order, each rounded to
    /// float32, so the same bits (`the_host_adam_is_the_tensor_adam_bit_for_bit`).
    fn step_host(&self, lr: f64, param: &mut [f32], grad: &[f32], state: &mut HostMoments) {
        assert_eq!(param.len(), grad.len(), "a gradient per parameter");
        let lr = lr as f32;
        let [b1, b2] = self.betas;
        let first = state.first.is_empty();
        if first {
            state.first.resize(param.len(), 0.0);
            state.second.resize(param.len(), 0.0);
            state.steps = 0;
        }
        assert_eq!(state.first.len(), param.len(), "a moment per parameter");
        assert_eq!(state.second.len(), param.len(), "a moment per parameter");
        state.steps += 1;
        let decay = (self.weight_decay > 0.0).then_some(1.0 - lr * self.weight_decay);
        let (from_gradient_m, from_gradient_v) = (1.0 - b1, 1.0 - b2);
        let correction = self.bias_correction.then(|| {
            let step = state.steps as i32;
            (
                lr / (1.0 - b1.powi(step)),
                1.0 / (1.0 - b2.powi(step)).sqrt(),
            )
        });
        let eps = self.eps;
        let moments = state.first.iter_mut().zip(state.second.iter_mut());
        for ((p, &g), (m, v)) in param.iter_mut().zip(grad).zip(moments) {
            let decayed = match decay {
                Some(keep) => *p * keep,
                None => *p,
            };
            let grad_m = g * from_gradient_m;
            let grad_v = g * g * from_gradient_v;
            let (next_m, next_v) = if first {
                (grad_m, grad_v)
            } else {
                (*m * b1 + grad_m, *v * b2 + grad_v)
            };
            *m = next_m;
            *v = next_v;
            *p = match correction {
                Some((c1, c2)) => decayed - next_m * c1 / (next_v.sqrt() * c2 + eps),
                None => decayed - next_m * lr / (next_v.sqrt() + eps),
            };
        }
    }
}

impl Optimizer for MlxAdam {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let lr = lr as f32;
        let [b1, b2] = self.betas;
        let tensor = if self.weight_decay > 0.0 {
            tensor.mul_scalar(1.0 - lr * self.weight_decay)
        } else {
            tensor
        };
        let grad_m = grad.clone().mul_scalar(1.0 - b1);
        let grad_v = grad.square().mul_scalar(1.0 - b2);
        let (step, m, v) = match state {
            Some(state) => (
                state.step + 1,
                state.m.mul_scalar(b1) + grad_m,
                state.v.mul_scalar(b2) + grad_v,
            ),
            None => (1, grad_m, grad_v),
        };
        let updated = if self.bias_correction {
            let c1 = lr / (1.0 - b1.powi(step as i32));
            let c2 = 1.0 / (1.0 - b2.powi(step as i32)).sqrt();
            tensor
                - m.clone().mul_scalar(c1) / (v.clone().sqrt().mul_scalar(c2).add_scalar(self.eps))
        } else {
            tensor - m.clone().mul_scalar(lr) / v.clone().sqrt().add_scalar(self.eps)
        };
        (updated, Some(AdamState { step, m, v }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamState {
            step: state.step,
            m: state.m.to_device(device),
            v: state.v.to_device(device),
        }
    }
}

/// MLX `RMSprop`: `v = α·v + (1 − α)·g²`; `p −= lr·g / (√v + eps)`.
#[derive(Clone, Debug)]
pub struct MlxRmsProp {
    alpha: f32,
    eps: f32,
}

impl Optimizer for MlxRmsProp {
    type State<const D: usize> = MomentState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let squared = grad.clone().square().mul_scalar(1.0 - self.alpha);
        let v = match state {
            Some(state) => state.moment.mul_scalar(self.alpha) + squared,
            None => squared,
        };
        let updated = tensor - grad.mul_scalar(lr as f32) / v.clone().sqrt().add_scalar(self.eps);
        (updated, Some(MomentState { moment: v }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        MomentState {
            moment: state.moment.to_device(device),
        }
    }
}

/// MLX `Lion`: `c = β₁·m + (1 − β₁)·g`; `m = β₂·m + (1 − β₂)·g`;
/// `p ← p·(1 − lr·wd) − lr·sign(c)`.
#[derive(Clone, Debug)]
pub struct MlxLion {
    betas: [f32; 2],
    weight_decay: f32,
}

impl Optimizer for MlxLion {
    type State<const D: usize> = MomentState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let lr = lr as f32;
        let [b1, b2] = self.betas;
        let (c, m) = match state {
            Some(state) => (
                state.moment.clone().mul_scalar(b1) + grad.clone().mul_scalar(1.0 - b1),
                state.moment.mul_scalar(b2) + grad.mul_scalar(1.0 - b2),
            ),
            None => (grad.clone().mul_scalar(1.0 - b1), grad.mul_scalar(1.0 - b2)),
        };
        let tensor = if self.weight_decay > 0.0 {
            tensor.mul_scalar(1.0 - lr * self.weight_decay)
        } else {
            tensor
        };
        (
            tensor - c.sign().mul_scalar(lr),
            Some(MomentState { moment: m }),
        )
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        MomentState {
            moment: state.moment.to_device(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    fn run<O: Optimizer>(optimizer: &O, start: f32, grads: &[f32], lr: f64) -> Vec<f32> {
        let device = crate::device::cpu();
        let mut p = Tensor::<1>::from_data(TensorData::new(vec![start], [1]), &device);
        let mut state = None;
        let mut trajectory = Vec::new();
        for &g in grads {
            let grad = Tensor::<1>::from_data(TensorData::new(vec![g], [1]), &device);
            let (next, next_state) = optimizer.step(lr, p, grad, state);
            p = next;
            state = next_state;
            trajectory.push(p.to_data().try_to_vec::<f32>().unwrap()[0]);
        }
        trajectory
    }

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    /// `n` values in [-1, 1) spread by `seed`.
    fn values(seed: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2_000)
            .map(|x| x as f32 / 997.0 - 1.0)
            .collect()
    }

    fn tensor(v: &[f32]) -> Tensor<1> {
        Tensor::<1>::from_data(
            TensorData::new(v.to_vec(), [v.len()]),
            &crate::device::cpu(),
        )
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn bits_of(t: Tensor<1>) -> Vec<u32> {
        bits(&t.into_data().try_to_vec::<f32>().unwrap())
    }

    #[test]
    fn the_host_rule_is_the_tensor_rule_bit_for_bit() {
        for momentum in [0.0, 0.9] {
            for weight_decay in [0.0, 0.013] {
                for dampening in [0.0, 0.1] {
                    for nesterov in [false, true] {
                        let sgd = MlxSgd {
                            momentum,
                            weight_decay,
                            dampening,
                            nesterov,
                        };
                        let mut host = values(7, 37);
                        let mut velocity = Vec::new();
                        let (mut p, mut state) = (tensor(&host), None);
                        for step in 0..3 {
                            let grad = values(step, 37);
                            sgd.step_host(0.05, &mut host, &grad, &mut velocity);
                            (p, state) = sgd.step(0.05, p, tensor(&grad), state);
                            assert_eq!(bits(&host), bits_of(p.clone()), "{sgd:?} step {step}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_host_adam_is_the_tensor_adam_bit_for_bit() {
        for weight_decay in [0.0, 0.013] {
            for bias_correction in [false, true] {
                let adam = MlxAdam {
                    betas: [0.9, 0.999],
                    eps: 1e-8,
                    weight_decay,
                    bias_correction,
                };
                let mut host = values(7, 37);
                let mut moments = HostMoments::default();
                let (mut p, mut state) = (tensor(&host), None);
                for step in 0..3 {
                    let grad = values(step, 37);
                    adam.step_host(0.01, &mut host, &grad, &mut moments);
                    (p, state) = adam.step(0.01, p, tensor(&grad), state);
                    assert_eq!(bits(&host), bits_of(p.clone()), "{adam:?} step {step}");
                }
            }
        }
    }

    #[test]
    fn sgd_momentum_follows_mlx() {
        let sgd = MlxSgd {
            momentum: 0.9,
            weight_decay: 0.0,
            dampening: 0.0,
            nesterov: false,
        };
        // v1 = 1, p = 1 - 0.1; v2 = 0.9 + 2 = 2.9, p = 0.9 - 0.29.
        close(&run(&sgd, 1.0, &[1.0, 2.0], 0.1), &[0.9, 0.61]);
        let nesterov = MlxSgd {
            nesterov: true,
            ..sgd.clone()
        };
        // update1 = g + μv = 1 + 0.9 = 1.9.
        close(&run(&nesterov, 1.0, &[1.0], 0.1), &[0.81]);
        let damped = MlxSgd {
            dampening: 0.5,
            ..sgd
        };
        // v1 = 0.5·1; v2 = 0.9·0.5 + 0.5·2 = 1.45.
        close(&run(&damped, 0.0, &[1.0, 2.0], 1.0), &[-0.5, -1.95]);
    }

    #[test]
    fn adam_without_bias_correction_follows_mlx() {
        let adam = MlxAdam {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: false,
        };
        // m = 0.1, v = 0.001: step = 0.1 · 0.1 / √0.001 = 0.316228.
        close(&run(&adam, 0.0, &[1.0], 0.1), &[-0.316_228]);
        let corrected = MlxAdam {
            bias_correction: true,
            ..adam.clone()
        };
        // Bias-corrected first step is lr·sign(g).
        close(&run(&corrected, 0.0, &[1.0], 0.1), &[-0.1]);
        let adamw = MlxAdam {
            weight_decay: 0.5,
            ..adam
        };
        // p = 1·(1 − 0.1·0.5) − 0.316228.
        close(&run(&adamw, 1.0, &[1.0], 0.1), &[0.95 - 0.316_228]);
    }

    #[test]
    fn rmsprop_and_lion_follow_mlx() {
        let rms = MlxRmsProp {
            alpha: 0.99,
            eps: 1e-8,
        };
        // v = 0.01·4 = 0.04: step = 0.1 · 2 / 0.2 = 1.
        close(&run(&rms, 0.0, &[2.0], 0.1), &[-1.0]);
        let lion = MlxLion {
            betas: [0.9, 0.99],
            weight_decay: 0.0,
        };
        close(&run(&lion, 0.0, &[3.0, -0.1], 0.1), &[-0.1, -0.2]);
    }
}
