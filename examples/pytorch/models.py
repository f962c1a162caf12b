"""cohort's built-in models as PyTorch modules.

cohort writes every model in PyTorch's layout (docs/ARCHITECTURE.md, "Tensor
layout"), so a model file loads into the matching class below as it is:

    import safetensors.torch
    from models import build

    model = build("lenet5")  # trainer.model_name of the run
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=True)
    model.eval()

Images are ``[N, C, H, W]`` float32 normalized as cohort does (MNIST's
``(pixel / 255 - 0.1307) / 0.3081``); a model built for other data takes the
data set's sample shape and classes, and the model's options
(``[parameters.model]`` beside ``num_classes``) as keyword arguments:

    model = build("resnet_20", num_classes=10, sample_shape=(3, 32, 32), norm="group")

The forward passes are cohort's (crates/cohort-train/src/model/); the layer
names are the state_dict keys. Evaluation mode matters for the models with
BatchNorm: it then uses the running statistics and dropout is off, as in
cohort's evaluation. ``check_twins.py`` holds every class here against
cohort's logits (``crates/cohort-train/tests/pytorch_twins.rs``).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class LeNet5(nn.Module):
    """``lenet5``: Plato's LeNet-5 (61,706 parameters)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.conv3 = nn.Conv2d(16, 120, 5)
        self.fc4 = nn.Linear(120, 84)
        self.fc5 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
        x = torch.flatten(F.relu(self.conv3(x)), 1)
        return self.fc5(F.relu(self.fc4(x)))


class LeNet5Compact(nn.Module):
    """``lenet5_compact``: the unpadded variant (44,426 parameters)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc3 = nn.Linear(16 * 4 * 4, 120)
        self.fc4 = nn.Linear(120, 84)
        self.fc5 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = torch.flatten(F.max_pool2d(F.relu(self.conv2(x)), 2, 2), 1)
        x = F.relu(self.fc3(x))
        return self.fc5(F.relu(self.fc4(x)))


class CnnBn(nn.Module):
    """``cnn_bn``: CNN with BatchNorm and dropout (207,018 parameters and 96
    running statistics). BatchNorm's defaults are cohort's: eps 1e-5,
    momentum 0.1."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc3 = nn.Linear(32 * 7 * 7, 128)
        self.fc4 = nn.Linear(128, num_classes)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, 2)
        x = torch.flatten(F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2, 2), 1)
        x = self.dropout(F.relu(self.fc3(x)))
        return self.fc4(x)


class Multilayer(nn.Module):
    """``multilayer``: Plato's MLP (hidden 1024, 512, 256, 128 with tanh by
    default); any sample shape, flattened."""

    def __init__(self, num_classes=10, sample_shape=(600,), hidden=(1024, 512, 256, 128),
                 activation="tanh"):
        super().__init__()
        widths = [math.prod(sample_shape), *hidden, num_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.activation = {"tanh": torch.tanh, "relu": F.relu}[activation]

    def forward(self, x):
        x = torch.flatten(x, 1)
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)


class Cnn(nn.Module):
    """``cnn``: McMahan et al. 2017's CNN (1,663,370 parameters on MNIST);
    ``cnn_femnist`` is the same with ``dense=2048`` (LEAF's FEMNIST CNN)."""

    def __init__(self, num_classes=10, sample_shape=(1, 28, 28), dense=512):
        super().__init__()
        channels, height, width = sample_shape
        self.conv1 = nn.Conv2d(channels, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * (height // 4) * (width // 4), dense)
        self.fc2 = nn.Linear(dense, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = torch.flatten(F.max_pool2d(F.relu(self.conv2(x)), 2, 2), 1)
        return self.fc2(F.relu(self.fc1(x)))


def norm_layer(norm, groups, channels):
    """``norm = "batch"`` or ``"group"`` (``groups`` groups), eps 1e-5 both."""
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(groups, channels)


class BasicBlock(nn.Module):
    """He et al.'s basic block. ``shortcut="A"``: where width or resolution
    changes, the input subsampled and zero-padded (no parameters); ``"B"``: a
    1x1 convolution and a norm (``shortcut.0``, ``shortcut.1``)."""

    def __init__(self, in_planes, planes, stride, norm, groups, shortcut):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(norm, groups, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm_layer(norm, groups, planes)
        self.stride, self.pad = stride, 0
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            if shortcut == "B":
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                    norm_layer(norm, groups, planes),
                )
            else:
                self.pad = (planes - in_planes) // 2

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if len(self.shortcut) or (self.stride == 1 and self.pad == 0):
            short = self.shortcut(x)
        else:
            short = x[:, :, ::self.stride, ::self.stride]
            short = F.pad(short, (0, 0, 0, 0, self.pad, self.pad))
        return F.relu(out + short)


class ResNet20(nn.Module):
    """``resnet_20``: He et al. 2016 §4.2, n = 3, option A shortcuts (the
    layout of akamaster/pytorch_resnet_cifar10); 269,722 parameters for 10
    classes. Global average pooling, so any image size."""

    def __init__(self, num_classes=10, sample_shape=(3, 32, 32), norm="batch", groups=2):
        super().__init__()
        self.conv1 = nn.Conv2d(sample_shape[0], 16, 3, padding=1, bias=False)
        self.bn1 = norm_layer(norm, groups, 16)
        blocks = lambda a, b, stride: nn.Sequential(*(
            BasicBlock(a if i == 0 else b, b, stride if i == 0 else 1, norm, groups, "A")
            for i in range(3)))
        self.layer1 = blocks(16, 16, 1)
        self.layer2 = blocks(16, 32, 2)
        self.layer3 = blocks(32, 64, 2)
        self.linear = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet18(nn.Module):
    """``resnet_18``: Plato's ResNet-18 (kuangliu/pytorch-cifar): 3x3 stem,
    option B shortcuts; 11,173,962 parameters for 10 classes. Global average
    pooling, Plato's ``avg_pool2d(out, 4)`` on 32x32 images."""

    def __init__(self, num_classes=10, sample_shape=(3, 32, 32), norm="batch", groups=2):
        super().__init__()
        self.conv1 = nn.Conv2d(sample_shape[0], 64, 3, padding=1, bias=False)
        self.bn1 = norm_layer(norm, groups, 64)
        blocks = lambda a, b, stride: nn.Sequential(
            BasicBlock(a, b, stride, norm, groups, "B"), BasicBlock(b, b, 1, norm, groups, "B"))
        self.layer1 = blocks(64, 64, 1)
        self.layer2 = blocks(64, 128, 2)
        self.layer3 = blocks(128, 256, 2)
        self.layer4 = blocks(256, 512, 2)
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ConvModule(nn.Module):
    """Plato's VGG convolution: 3x3, padding 1, with bias; norm; ReLU."""

    def __init__(self, in_filters, out_filters, norm, groups):
        super().__init__()
        self.conv = nn.Conv2d(in_filters, out_filters, 3, padding=1)
        self.bn = norm_layer(norm, groups, out_filters)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Vgg11(nn.Module):
    """``vgg_11``: Plato's VGG-11 (plan A, BatchNorm, one linear layer);
    9,231,114 parameters for 10 classes. Global average pooling, Plato's
    ``AvgPool2d(2)`` on 32x32 images."""

    PLAN = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512]

    def __init__(self, num_classes=10, sample_shape=(3, 32, 32), norm="batch", groups=2):
        super().__init__()
        layers, filters = [], sample_shape[0]
        for step in self.PLAN:
            if step == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers.append(ConvModule(filters, step, norm, groups))
                filters = step
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(x), 1), 1))


class LstmShakespeare(nn.Module):
    """``lstm_shakespeare``: LEAF's Shakespeare model (embedding 8, two LSTM
    layers of 256, dense to the vocabulary); 819,920 parameters for 80
    characters. Takes ``[N, length]`` int64 token ids. ``outputs="last"``
    gives the last position's logits, ``"every"`` every position's
    (``[N * length, vocabulary]``)."""

    def __init__(self, num_classes=80, sample_shape=(80,), outputs="last"):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, 8)
        self.lstm = nn.LSTM(8, 256, num_layers=2, batch_first=True)
        self.fc = nn.Linear(256, num_classes)
        self.every = outputs == "every"

    def forward(self, tokens):
        x, _ = self.lstm(self.embedding(tokens))
        x = x.reshape(-1, x.shape[-1]) if self.every else x[:, -1, :]
        return self.fc(x)


MODELS = {
    "lenet5": LeNet5,
    "lenet5_compact": LeNet5Compact,
    "cnn_bn": CnnBn,
    "multilayer": Multilayer,
    "cnn": Cnn,
    "resnet_20": ResNet20,
    "cnn_femnist": lambda **kw: Cnn(dense=2048, **kw),
    "resnet_18": ResNet18,
    "vgg_11": Vgg11,
    "lstm_shakespeare": LstmShakespeare,
}

# The LeNets and cnn_bn take MNIST's samples only.
FIXED_SHAPE = {"lenet5", "lenet5_compact", "cnn_bn"}


def build(model_name, num_classes=10, sample_shape=None, **options):
    """The module for ``trainer.model_name``, for the data set's
    ``sample_shape`` and the model's options (``[parameters.model]``)."""
    if model_name in FIXED_SHAPE:
        if options or sample_shape not in (None, (1, 28, 28), [1, 28, 28]):
            raise ValueError(f"{model_name} takes [1, 28, 28] samples and no options")
        return MODELS[model_name](num_classes)
    if sample_shape is not None:
        options["sample_shape"] = tuple(sample_shape)
    return MODELS[model_name](num_classes=num_classes, **options)
