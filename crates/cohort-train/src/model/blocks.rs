//! Layers the ResNets share: the normalization a model is built with
//! (`norm = "batch" | "group"`) and He et al.'s basic residual block with
//! either shortcut.
//!
//! Names follow the PyTorch twins (`examples/pytorch/models.py`): a block's
//! `conv1`, `bn1`, `conv2`, `bn2`, and for a projection shortcut
//! `shortcut.0` (the 1×1 convolution) and `shortcut.1` (its normalization),
//! an `nn.Sequential` in PyTorch. The normalization keeps the name `bn*`
//! whichever kind it is, so the layout of a model differs between `norm`s
//! only by BatchNorm's running statistics: enum variants add no name
//! (`params.rs`).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, GroupNorm, GroupNormConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Slice, Tensor};

use super::{
    ModelError, ModelSpec, batch_norm, batch_norm_relu, conv2d, group_norm, group_norm_relu,
};

/// Which normalization a model's layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// BatchNorm (eps 1e-5, momentum 0.1, PyTorch's defaults): running
    /// statistics travel with the model and are averaged like weights.
    Batch,
    /// GroupNorm with this many groups (eps 1e-5): no running statistics,
    /// the usual choice under non-IID data (Hsieh et al., ICML 2020).
    Group(usize),
}

impl NormKind {
    /// GroupNorm's default number of groups.
    pub const DEFAULT_GROUPS: usize = 2;

    /// The options `norm` (`"batch"`, the default, or `"group"`) and, for
    /// GroupNorm, `groups` (default 2), which must divide every width in
    /// `channels`.
    pub fn from_spec(spec: &ModelSpec, channels: &[usize]) -> Result<Self, ModelError> {
        let norm = spec.options.choice("norm", &["batch", "group"], "batch")?;
        let given = spec.options.given("groups");
        let groups = spec.options.count("groups", Self::DEFAULT_GROUPS)?;
        if norm == "batch" {
            if given {
                return Err(ModelError(
                    "parameters.model.groups is GroupNorm's: it needs norm = \"group\"".to_owned(),
                ));
            }
            return Ok(Self::Batch);
        }
        if let Some(width) = channels.iter().find(|&&c| c % groups != 0) {
            return Err(ModelError(format!(
                "parameters.model.groups = {groups} does not divide the {width} channels of a \
                 layer of this model"
            )));
        }
        Ok(Self::Group(groups))
    }

    pub fn init(self, channels: usize, device: &Device) -> Norm {
        match self {
            Self::Batch => Norm::Batch(BatchNormConfig::new(channels).init(device)),
            Self::Group(groups) => Norm::Group(GroupNormConfig::new(groups, channels).init(device)),
        }
    }
}

/// A normalization layer of either kind.
#[derive(Module, Debug)]
pub enum Norm {
    Batch(BatchNorm),
    Group(GroupNorm),
}

impl Norm {
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            Self::Batch(norm) => batch_norm(norm, x),
            Self::Group(norm) => group_norm(norm, x),
        }
    }

    /// `relu(self.forward(x))`, as one pass each way on the CPU.
    pub fn forward_relu(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            Self::Batch(norm) => batch_norm_relu(norm, x),
            Self::Group(norm) => group_norm_relu(norm, x),
        }
    }
}

/// A 3×3 convolution, padding 1, no bias (a normalization follows).
pub fn conv3x3(input: usize, output: usize, stride: usize, device: &Device) -> Conv2d {
    Conv2dConfig::new([input, output], [3, 3])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .with_bias(false)
        .init(device)
}

/// One layer of a projection shortcut (`shortcut.0`, `shortcut.1`).
#[derive(Module, Debug)]
pub enum ShortcutLayer {
    Conv(Conv2d),
    Norm(Norm),
}

/// How a block that changes width or resolution adds its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortcut {
    /// He et al.'s option A: the input subsampled (`x[:, :, ::s, ::s]`) and
    /// zero-padded to the new width, no parameters.
    PadIdentity,
    /// Option B: a 1×1 convolution with stride and a normalization.
    Projection,
}

/// He et al.'s basic block: conv 3×3 (stride), norm, ReLU, conv 3×3, norm,
/// plus the shortcut, ReLU.
#[derive(Module, Debug)]
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: Norm,
    conv2: Conv2d,
    bn2: Norm,
    /// Empty for the identity and for option A.
    shortcut: Vec<ShortcutLayer>,
    stride: usize,
    /// Zero channels added on each side by option A's shortcut.
    pad_channels: usize,
}

impl BasicBlock {
    pub fn new(
        input: usize,
        output: usize,
        stride: usize,
        norm: NormKind,
        kind: Shortcut,
        device: &Device,
    ) -> Self {
        let changes = stride != 1 || input != output;
        let shortcut = if changes && kind == Shortcut::Projection {
            let conv = Conv2dConfig::new([input, output], [1, 1])
                .with_stride([stride, stride])
                .with_bias(false)
                .init(device);
            vec![
                ShortcutLayer::Conv(conv),
                ShortcutLayer::Norm(norm.init(output, device)),
            ]
        } else {
            Vec::new()
        };
        let pad_channels = if changes && kind == Shortcut::PadIdentity {
            (output - input) / 2
        } else {
            0
        };
        Self {
            conv1: conv3x3(input, output, stride, device),
            bn1: norm.init(output, device),
            conv2: conv3x3(output, output, 1, device),
            bn2: norm.init(output, device),
            shortcut,
            stride,
            pad_channels,
        }
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let out = self.bn1.forward_relu(conv2d(&self.conv1, x.clone()));
        let out = self.bn2.forward(conv2d(&self.conv2, out));
        relu(out + self.shortcut(x))
    }

    fn shortcut(&self, x: Tensor<4>) -> Tensor<4> {
        if !self.shortcut.is_empty() {
            return self.shortcut.iter().fold(x, |x, layer| match layer {
                ShortcutLayer::Conv(conv) => conv2d(conv, x),
                ShortcutLayer::Norm(norm) => norm.forward(x),
            });
        }
        if self.stride == 1 && self.pad_channels == 0 {
            return x;
        }
        let x = subsample(x, self.stride);
        if self.pad_channels == 0 {
            return x;
        }
        let [batch, _, height, width] = x.dims();
        let zeros = Tensor::<4>::zeros([batch, self.pad_channels, height, width], &x.device());
        Tensor::cat(vec![zeros.clone(), x, zeros], 1)
    }
}

/// Every `stride`-th row and column, from the first: Python's
/// `x[:, :, ::stride, ::stride]`, as a strided view (its gradient written
/// back into zeros), not a gather whose gradient is a scatter-add.
fn subsample(x: Tensor<4>, stride: usize) -> Tensor<4> {
    let every = Slice::new(0, None, stride as isize);
    x.slice([Slice::full(), Slice::full(), every, every])
}

/// Global average pooling, `[batch, channels, h, w]` → `[batch, channels]`
/// (`F.adaptive_avg_pool2d(x, 1)` flattened).
pub fn global_average(x: Tensor<4>) -> Tensor<2> {
    x.mean_dim(3).mean_dim(2).flatten::<2>(1, 3)
}
