"""Learning-rate schedules, weight-decay masks and the optimizer flags both recipes share,
all through Optax.

``--lr`` is the peak rate, reached after ``--warmup-steps`` of linear warmup from 0, then
decayed over the remaining steps to ``--min-lr-ratio · lr``: by a half cosine (Loshchilov &
Hutter 2017, "SGDR"), linearly, or not at all (constant). Weight decay is decoupled (AdamW,
Loshchilov & Hutter 2019) and masked: parameters whose path matches the no-decay pattern (norm
scales, biases, embeddings: decaying them only fights normalisation or shrinks rare tokens'
vectors) are left alone.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import optax
from shardkit.rules import path_str

DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule.

    Attributes:
        lr: peak learning rate.
        steps: total training steps (the decay ends there).
        warmup_steps: linear warmup from 0 to ``lr`` over this many steps (0: start at ``lr``).
        decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after the warmup.
        min_lr_ratio: the rate at ``steps`` as a fraction of ``lr`` (cosine and linear).
    """

    lr: float
    steps: int
    warmup_steps: int = 0
    decay: str = "cosine"
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must be in [0, --steps {self.steps}]")
        if self.decay not in DECAYS:
            raise ValueError(f"--decay {self.decay!r} is not one of {', '.join(DECAYS)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio} must be in [0, 1]")

    def __call__(self) -> optax.Schedule:
        """The Optax schedule: step → learning rate."""
        peak, end = self.lr, self.lr * self.min_lr_ratio
        if self.decay == "cosine" and self.warmup_steps < self.steps:
            return optax.warmup_cosine_decay_schedule(0.0, peak, self.warmup_steps, self.steps, end)
        rest = max(1, self.steps - self.warmup_steps)
        after = (optax.linear_schedule(peak, end, rest) if self.decay == "linear"
                 else optax.constant_schedule(peak))
        if self.warmup_steps == 0:
            return after
        return optax.join_schedules([optax.linear_schedule(0.0, peak, self.warmup_steps), after],
                                    [self.warmup_steps])


def decay_mask(no_decay: str | None) -> Callable:
    """A function params → tree of bools for ``optax.add_decayed_weights(mask=)`` /
    ``optax.adamw(mask=)``: True where weight decay applies.

    Args:
        no_decay: a regex ``re.search``ed on each leaf's ``/``-joined path (as in
            ``sk.PathRules``); matching leaves are not decayed. ``None``: decay everything
            with at least 2 dimensions (kernels, not the 1-D scales and biases).

    Raises:
        ValueError: ``no_decay`` is not a valid regex.
    """
    if no_decay is None:
        return lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    try:
        pattern = re.compile(no_decay)
    except re.error as e:
        raise ValueError(f"--no-decay {no_decay!r} is not a regular expression: {e}") from None
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda path, p: pattern.search(path_str(path)) is None, params)


def add_flags(parser: argparse.ArgumentParser, *, lr: float | None, warmup: str, weight_decay: float,
              no_decay: str | None, grad_clip: float | None, min_lr_ratio: float = 0.1,
              lr_help: str = "") -> None:
    """The schedule/regularisation flags, with the recipe's defaults."""
    a = parser.add_argument
    a("--lr", type=float, default=lr, help="peak learning rate" + (f" (default {lr:g})" if lr else lr_help))
    a("--warmup-steps", type=int, default=None, help=f"linear warmup steps (default {warmup})")
    a("--decay", default="cosine", help=f"learning-rate decay after the warmup: {', '.join(DECAYS)} (default cosine)")
    a("--min-lr-ratio", type=float, default=min_lr_ratio, help=f"final learning rate / peak (default {min_lr_ratio:g})")
    a("--weight-decay", type=float, default=weight_decay, help=f"decoupled weight decay (default {weight_decay:g})")
    a("--no-decay", default=no_decay, metavar="REGEX", help="parameters whose path matches are not "
      "decayed (default " + (repr(no_decay) if no_decay else "every 1-D parameter: scales and biases") + ")")
    a("--grad-clip", type=float, default=grad_clip, help="clip gradients to this global norm (0: off; "
      f"default {grad_clip or 'off'})")


def schedule_from(args, steps: int, default_warmup: int) -> Schedule:
    """The ``Schedule`` the flags describe (``--warmup-steps`` defaults to ``default_warmup``).

    Raises:
        ValueError: a flag out of range (the message names it).
    """
    warmup = default_warmup if args.warmup_steps is None else args.warmup_steps
    return Schedule(args.lr, steps, warmup, args.decay, args.min_lr_ratio)


def grad_clip_from(args) -> float | None:
    """``clip_norm`` for ``sk.train_step``: None when ``--grad-clip`` is 0 or unset.

    Raises:
        ValueError: a negative ``--grad-clip``.
    """
    if args.grad_clip is not None and args.grad_clip < 0:
        raise ValueError(f"--grad-clip must be >= 0 (0: off), got {args.grad_clip}")
    return args.grad_clip or None
