"""Models written once, PyTorch style, and defined twice: with ``torch.nn`` and with ``mn.nn``.

``define(nn, F, T)`` returns the classes for one namespace: ``nn`` (torch.nn or meganeura.nn),
``F`` (its functional module) and ``T`` (``torch`` or ``meganeura``, for ``cat`` and
``flatten``). That the same source runs on both is the porting claim the tests check.
"""

from __future__ import annotations


def define(nn, F, T):
    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride=1):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            identity = x if self.downsample is None else self.downsample(x)
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        """torchvision's resnet18 topology and names."""

        def __init__(self, num_classes=10):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
            widths, cin = [64, 128, 256, 512], 64
            for i, w in enumerate(widths):
                stride = 1 if i == 0 else 2
                setattr(
                    self,
                    f"layer{i + 1}",
                    nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w)),
                )
                cin = w
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(T.flatten(self.avgpool(x), 1))

    class PreLNBlock(nn.Module):
        def __init__(self, d, heads, ff):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(
                nn.Linear(d, ff), nn.GELU(approximate="tanh"), nn.Linear(ff, d)
            )

        def forward(self, x):
            h = self.ln1(x)
            a, _ = self.attn(h, h, h, need_weights=False)
            x = x + a
            return x + self.mlp(self.ln2(x))

    class PreLNTransformer(nn.Module):
        def __init__(self, vocab=50, d=32, heads=4, ff=64, layers=2, max_len=16):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(T.randn(max_len, d) * 0.02)
            self.blocks = nn.ModuleList([PreLNBlock(d, heads, ff) for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.tok(ids) + self.pos[: ids.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    class ResBlock(nn.Module):
        def __init__(self, cin, cout, groups):
            super().__init__()
            self.norm1 = nn.GroupNorm(groups, cin)
            self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
            self.norm2 = nn.GroupNorm(groups, cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x):
            h = self.conv1(F.silu(self.norm1(x)))
            h = self.conv2(F.silu(self.norm2(h)))
            return h + self.skip(x)

    class UNet(nn.Module):
        """Two levels, a strided-conv down path, a transposed-conv and a nearest up path."""

        def __init__(self, cin=3, base=8, groups=4):
            super().__init__()
            self.conv_in = nn.Conv2d(cin, base, 3, padding=1)
            self.down1 = ResBlock(base, base, groups)
            self.pool = nn.Conv2d(base, base, 3, stride=2, padding=1)
            self.down2 = ResBlock(base, 2 * base, groups)
            self.pool2 = nn.MaxPool2d(2)
            self.mid = ResBlock(2 * base, 2 * base, groups)
            self.up2 = nn.Upsample(scale_factor=2, mode="nearest")
            self.dec2 = ResBlock(4 * base, 2 * base, groups)
            self.up1 = nn.ConvTranspose2d(2 * base, base, 2, stride=2)
            self.dec1 = ResBlock(2 * base, base, groups)
            self.out = nn.Sequential(
                nn.GroupNorm(groups, base), nn.SiLU(), nn.Conv2d(base, cin, 3, padding=1)
            )

        def forward(self, x):
            s1 = self.down1(self.conv_in(x))
            s2 = self.down2(self.pool(s1))
            h = self.mid(self.pool2(s2))
            h = self.dec2(T.cat([self.up2(h), s2], 1))
            h = self.dec1(T.cat([self.up1(h), s1], 1))
            return self.out(h)

    class W5ResBlock(nn.Module):
        def __init__(self, cin, cout, groups, eps):
            super().__init__()
            self.norm1 = nn.GroupNorm(groups, cin, eps=eps)
            self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
            self.norm2 = nn.GroupNorm(groups, cout, eps=eps)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

        def forward(self, x):
            h = self.conv1(F.silu(self.norm1(x)))
            return self.conv2(F.silu(self.norm2(h))) + self.skip(x)

    class W5UNet(nn.Module):
        """meganeura.models.unet.UNet (workload W5) rewritten from its docstring: a twin that
        loads its state dict, so the library model can be checked against torch (also the
        torch side of the W5 benchmark, ``bench/workloads_lib/w5_unet.py``)."""

        def __init__(self, cin, cout, base, mult, groups, eps=1e-5):
            super().__init__()
            chans = [base * m for m in mult]
            self.conv_in = nn.Conv2d(cin, chans[0], 3, padding=1, bias=False)
            self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
            c_prev = chans[0]
            for i, c in enumerate(chans):
                self.down.append(W5ResBlock(c_prev, c, groups, eps))
                if i < len(chans) - 1:
                    self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1, bias=False))
                c_prev = c
            self.mid = W5ResBlock(c_prev, c_prev, groups, eps)
            self.up = nn.ModuleList()
            for c in reversed(chans):
                self.up.append(W5ResBlock(c_prev + c, c, groups, eps))
                c_prev = c
            self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
            self.norm_out = nn.GroupNorm(groups, c_prev, eps=eps)
            self.conv_out = nn.Conv2d(c_prev, cout, 3, padding=1, bias=False)

        def forward(self, x):
            h, skips = self.conv_in(x), []
            for i, block in enumerate(self.down):
                h = block(h)
                skips.append(h)
                if i < len(self.downsample):
                    h = self.downsample[i](h)
            h = self.mid(h)
            for i, block in enumerate(self.up):
                h = block(T.cat([h if i == 0 else self.upsample(h), skips.pop()], 1))
            return self.conv_out(F.silu(self.norm_out(h)))

    return {
        "ResNet18": ResNet18,
        "PreLNTransformer": PreLNTransformer,
        "UNet": UNet,
        "W5UNet": W5UNet,
    }
