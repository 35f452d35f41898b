"""ResNet-18 in its CIFAR form (3x3 stem, no max-pool) for small images, of any width.

Four stages of two basic blocks each, with ``width``, 2, 4 and 8 times ``width`` channels
and strides 1, 2, 2, 2; global average pooling and one linear layer. ``width=64`` is the
classic 11 M-parameter network; 28x28 inputs end as 4x4 maps before pooling.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

#: builds a normalisation layer for a number of channels
NormFactory = Callable[[int], nn.Module]


def norm_layer(kind: str) -> NormFactory:
    """A factory for ``"batch"`` (BatchNorm2d) or ``"group"`` (GroupNorm, 8 channels a group)."""
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "group":
        return lambda channels: nn.GroupNorm(max(1, channels // 8), channels)
    raise ValueError(f"norm must be 'batch' or 'group', got {kind!r}")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (a 1x1 projection when shapes change)."""

    def __init__(self, in_channels: int, channels: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = norm(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), norm(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        """The block's output: relu(norm(conv(relu(norm(conv(x))))) + shortcut(x))."""
        out = self.norm1(self.conv1(x)).relu()
        out = self.norm2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: ``in_channels`` images to ``classes`` logits."""

    def __init__(
        self, in_channels: int = 1, classes: int = 10, width: int = 32, norm: str = "batch"
    ) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be positive, got {width}")
        make_norm = norm_layer(norm)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), make_norm(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = width
        for stage, stride in enumerate((1, 2, 2, 2)):
            out_channels = width * 2**stage
            blocks.append(BasicBlock(channels, out_channels, stride, make_norm))
            blocks.append(BasicBlock(out_channels, out_channels, 1, make_norm))
            channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (batch, classes) for images of shape (batch, channels, H, W)."""
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))
