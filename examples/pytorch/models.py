"""cohort's built-in models as PyTorch modules.

cohort writes every model in PyTorch's layout (docs/ARCHITECTURE.md, "Tensor
layout"), so a model file loads into the matching class below as it is:

    import safetensors.torch
    from models import build

    model = build("lenet5")  # trainer.model_name of the run
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=True)
    model.eval()

Images are ``[N, 1, 28, 28]`` float32 normalized as cohort does:
``(pixel / 255 - 0.1307) / 0.3081``. The forward passes are cohort's
(crates/cohort-train/src/model.rs); the layer names are the state_dict keys.
Evaluation mode matters for ``cnn_bn``: BatchNorm then uses the running
statistics and dropout is off, as in cohort's evaluation.
"""

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


MODELS = {"lenet5": LeNet5, "lenet5_compact": LeNet5Compact, "cnn_bn": CnnBn}


def build(model_name, num_classes=10):
    """The module for ``trainer.model_name``."""
    return MODELS[model_name](num_classes)
