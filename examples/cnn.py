"""Plan a ResNet-style CNN for image classification (no GPU, no weights allocated).

    python examples/cnn.py --cluster 2x8xA100-80GB --batch 256 --out cnn-plan.json
    autopar plan examples.cnn:build --cluster 8xH100 -o cnn-plan.json     # the same through the CLI
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.report import summary


class Residual(nn.Module):
    """Two 3×3 convolutions with batch norm and a skip connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, width: int = 64, blocks_per_stage: int = 2, stages: int = 4, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.stages = nn.ModuleList()
        self.downs = nn.ModuleList()
        channels = width
        for s in range(stages):
            self.stages.append(nn.Sequential(*(Residual(channels) for _ in range(blocks_per_stage))))
            if s < stages - 1:
                self.downs.append(nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False))
                channels *= 2
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, stride=2, padding=1)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i < len(self.downs):
                x = F.relu(self.downs[i](x))
        return self.head(x.mean(dim=(2, 3)))


def build(batch: int = 64, image: int = 224, width: int = 64, device: str = "meta"):
    """Model and an example batch of images; on the meta device by default."""
    with torch.device(device):
        model = ResNet(width=width)
        images = torch.zeros(batch, 3, image, image)
    return model, (images,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="8xH100")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--out", default="cnn-plan.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model, inputs = build(batch=args.batch, image=args.image)
    plan = autopar.plan(model, inputs, cluster=args.cluster)
    plan.save(args.out)
    print(summary(plan))
    print(f"plan written to {args.out}")


if __name__ == "__main__":
    main()
