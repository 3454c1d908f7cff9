"""Shapes of the ResNet recipe: one frozen dataclass and the standard depths."""

from __future__ import annotations

from dataclasses import dataclass

# depth -> (block kind, blocks per stage); He et al. 2016, table 1.
DEPTHS: dict[int, tuple[str, tuple[int, ...]]] = {
    10: ("basic", (1, 1, 1, 1)),  # not in the paper: every stage once, for tests and CPU runs
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
STEMS = ("cifar", "imagenet")


@dataclass(frozen=True)
class Config:
    """A ResNet (v1.5: the stride sits in the 3x3 conv of a bottleneck block).

    Attributes:
        depth: 18 or 34 (basic blocks), 50, 101 or 152 (bottleneck blocks); 10 (one basic
            block per stage) is a small variant for tests.
        num_classes: width of the classifier.
        in_channels: image channels (1 for the digits, 3 for RGB).
        stem: ``"cifar"`` (3x3 stride-1 conv, no pooling: for 32x32 images) or
            ``"imagenet"`` (7x7 stride-2 conv + 3x3 stride-2 max-pool: for 224x224).
        width: multiplier on the stage widths 64, 128, 256, 512 (``0.125`` gives 8..64, for
            tests and CPU runs); every width is rounded to a multiple of 8 so it still
            divides an 8-way mesh axis.
        bn_momentum: running-average decay of the BatchNorm statistics (0.9, as in PyTorch;
            short runs need the faster average to have usable statistics at eval time).
        bn_eps: BatchNorm epsilon.
        zero_init_residual: start the last BatchNorm scale of each block at zero, so every
            block begins as the identity (Goyal et al. 2017).
    """

    depth: int = 18
    num_classes: int = 10
    in_channels: int = 3
    stem: str = "cifar"
    width: float = 1.0
    bn_momentum: float = 0.9
    bn_eps: float = 1e-5
    zero_init_residual: bool = True

    def __post_init__(self):
        if self.depth not in DEPTHS:
            raise ValueError(f"Config.depth={self.depth!r}; choose one of {sorted(DEPTHS)}")
        if self.stem not in STEMS:
            raise ValueError(f"Config.stem={self.stem!r}; choose one of {STEMS}")
        if not self.width > 0:
            raise ValueError(f"Config.width={self.width!r} must be positive (1.0 is the standard width)")
        for name in ("num_classes", "in_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"Config.bn_momentum={self.bn_momentum!r} must be in [0, 1)")

    @property
    def block(self) -> str:
        return DEPTHS[self.depth][0]

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        return DEPTHS[self.depth][1]

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1

    def stage_width(self, i: int) -> int:
        """Inner width of stage ``i`` (the bottleneck's narrow width; its output is 4x)."""
        return max(8, int(round(64 * 2 ** i * self.width / 8)) * 8)
