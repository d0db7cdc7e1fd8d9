"""ResNet (He et al., CVPR 2016) with torchvision's v1.5 topology and state-dict names: the
stride of a bottleneck stage sits on its 3x3 convolution, downsampling shortcuts are a 1x1
convolution and a BatchNorm, and ``resnet18 .. resnet101`` match torchvision's layer counts,
so a torchvision state dict loads unchanged.

Shapes: input f32 [N, 3, H, W] -> logits f32 [N, num_classes]. BatchNorm uses batch
statistics and updates its running statistics in train mode, running statistics in eval mode.
Initialization as torchvision's: kaiming_normal_(fan_out, relu) for convolutions, BatchNorm
weight 1 and bias 0, Linear as torch.nn.Linear (optionally the last BN of each block zeroed).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import nn
from ..nn import functional as F
from ..nn import init


def conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1, dilation: int = 1):
    return nn.Conv2d(cin, cout, 3, stride, dilation, groups=groups, bias=False, dilation=dilation)


def conv1x1(cin: int, cout: int, stride: int = 1):
    return nn.Conv2d(cin, cout, 1, stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


@dataclass(frozen=True)
class ResNetConfig:
    """``block`` "basic" or "bottleneck" and the block count of each of the four stages.

    ``width`` is the channel count of the stem and of the first stage's blocks (``planes``);
    the stages use ``width, 2 width, 4 width, 8 width``. torchvision's models all have 64;
    smaller widths give CPU-sized models with the same topology and state-dict names.
    """

    block: str = "basic"
    layers: tuple[int, int, int, int] = (2, 2, 2, 2)
    num_classes: int = 1000
    zero_init_residual: bool = False
    width: int = 64


CONFIGS = {
    "resnet18": ResNetConfig("basic", (2, 2, 2, 2)),
    "resnet34": ResNetConfig("basic", (3, 4, 6, 3)),
    "resnet50": ResNetConfig("bottleneck", (3, 4, 6, 3)),
    "resnet101": ResNetConfig("bottleneck", (3, 4, 23, 3)),
}


class ResNet(nn.Module):
    """torchvision.models.ResNet (groups 1, width 64)."""

    def __init__(self, cfg: ResNetConfig = CONFIGS["resnet18"]) -> None:
        super().__init__()
        if cfg.block not in ("basic", "bottleneck"):
            raise ValueError(f"block must be 'basic' or 'bottleneck', got {cfg.block!r}")
        block = BasicBlock if cfg.block == "basic" else Bottleneck
        if cfg.width < 1:
            raise ValueError(f"width must be >= 1, got {cfg.width}")
        w = cfg.width
        self.config = cfg
        self.inplanes = w
        self.conv1 = nn.Conv2d(3, w, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, w, cfg.layers[0])
        self.layer2 = self._make_layer(block, 2 * w, cfg.layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * w, cfg.layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * w, cfg.layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * w * block.expansion, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                init.ones_(m.weight)
                init.zeros_(m.bias)
        if cfg.zero_init_residual:
            for m in self.modules():
                last = getattr(m, "bn3" if isinstance(m, Bottleneck) else "bn2", None)
                if isinstance(m, (BasicBlock, Bottleneck)) and last is not None:
                    init.zeros_(last.weight)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.flatten(self.avgpool(x), 1))


def resnet(name: str = "resnet18", num_classes: int = 1000, width: int = 64) -> ResNet:
    """``resnet18``, ``resnet34``, ``resnet50`` or ``resnet101`` with ``num_classes`` outputs
    (``width``: ``ResNetConfig.width``, 64 for torchvision's models).

    Raises:
        ValueError: an unknown name (the message lists the known ones) or ``width < 1``.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown ResNet {name!r}; known: {sorted(CONFIGS)}")
    base = CONFIGS[name]
    return ResNet(ResNetConfig(base.block, base.layers, num_classes, width=width))
