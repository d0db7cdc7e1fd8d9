"""W3: ResNet-50, ``meganeura.models.resnet`` against torchvision's ``resnet50(weights=None)``
(or, where torchvision is not installed, :func:`torch_resnet`: the same v1.5 topology and
state-dict names written out here). Inference in eval mode (BatchNorm from running
statistics); training in train mode (batch statistics, running-statistic updates)."""

from __future__ import annotations

import numpy as np

from .base import Case, Workload
from .weights import sin_input


def torch_resnet(layers=(3, 4, 6, 3), num_classes=1000, width=64):
    """torchvision's ResNet with bottlenecks (v1.5: stride on the 3x3), torchvision's names;
    stages of ``width * (1, 2, 4, 8)`` planes (torchvision: 64)."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, planes, stride, down):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = down

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            idt = x if self.downsample is None else self.downsample(x)
            return self.relu(out + idt)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = width
            planes_of = (width, 2 * width, 4 * width, 8 * width)
            for i, (n, planes) in enumerate(zip(layers, planes_of, strict=True)):
                blocks = []
                for b in range(n):
                    stride = 2 if (i > 0 and b == 0) else 1
                    down = None
                    if b == 0 and (stride != 1 or cin != planes * 4):
                        down = nn.Sequential(
                            nn.Conv2d(cin, planes * 4, 1, stride, bias=False),
                            nn.BatchNorm2d(planes * 4),
                        )
                    blocks.append(Bottleneck(cin, planes, stride, down))
                    cin = planes * 4
                setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet()


class ResNet50(Workload):
    id, name, title = "w3", "resnet50", "ResNet-50"
    paper = {"fwd": ("fwd_b4", 6.2, 7.4), "train": ("train_b4", 18.1, 17.5), "first_s": 37}

    def _layers(self, quick):
        return (1, 1, 1, 1) if quick else (3, 4, 6, 3)

    def _classes(self, quick):
        return 10 if quick else 1000

    def _width(self, quick) -> int:
        """16 when quick and ``ResNetConfig`` has ``width`` (CPU-sized), else torchvision's 64."""
        import dataclasses

        from meganeura.models.resnet import ResNetConfig

        has = any(f.name == "width" for f in dataclasses.fields(ResNetConfig))
        return 16 if quick and has else 64

    def cases(self, quick):
        # quick: 32 x 32 images; layer4 is then 1 x 1, so train-mode BatchNorm there sees
        # batch values per channel: with 2 its normalization is ill-conditioned (gradients
        # that differ by rounding, cos 0.25), with 4 the gates pass
        return [
            Case("fwd_b4", "fwd", {"batch": 4}),
            Case("fwd_b1", "fwd", {"batch": 1}),
            Case("train_b4", "train", {"batch": 4}),
            Case("fwdbwd_b4", "fwdbwd", {"batch": 4}),
            Case("train_adam_b4", "train", {"batch": 4}, ("adam", 1e-5)),
        ]

    def build_ours(self, case, quick):
        import meganeura as mn
        from meganeura.models.resnet import ResNet, ResNetConfig

        mn.manual_seed(0)
        cfg = ResNetConfig("bottleneck", self._layers(quick), self._classes(quick))
        if self._width(quick) != 64:
            cfg = ResNetConfig(**{**cfg.__dict__, "width": self._width(quick)})
        model = ResNet(cfg)
        return model.train() if case.trains else model.eval()

    def build_torch(self, case, quick):
        m = None
        if not quick:
            try:
                import torchvision

                m = torchvision.models.resnet50(weights=None)
            except ImportError:
                m = None
        if m is None:
            m = torch_resnet(self._layers(quick), self._classes(quick), self._width(quick))
        return m.train() if case.trains else m.eval()

    def batch(self, case, quick):
        side = 32 if quick else 224
        n = case.params["batch"]
        x = sin_input((n, 3, side, side), 1.0)
        if case.kind == "fwd":
            return (x,)
        return x, (np.arange(n) % self._classes(quick)).astype(np.int32)

    def ours_loss(self, model, x, labels):
        import meganeura.nn.functional as F

        return F.cross_entropy(model(x), labels)

    def torch_loss(self, m, x, labels):
        import torch

        return torch.nn.functional.cross_entropy(m(x).float(), labels)
