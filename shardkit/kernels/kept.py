"""The names the attention kernels give the values their backward reads, so that a
``jax.checkpoint`` policy that saves names (``keep="lean"``, ``sk.LEAN_RESIDUALS``) keeps them
and the backward never runs the kernel's forward again.

A flash kernel's custom VJP keeps its output and its log-sum-exp (Dao et al. 2022,
FlashAttention, alg. 2: ``P = exp(S - lse)``, ``delta = rowsum(dO * O)``). Unnamed, a names
policy cannot save them: partial evaluation recomputes them, and with them the whole kernel
forward, in the backward. ``sk.attention`` and ``sk.context_attention`` name the output they
return ``OUTPUT`` and keep that same value as the residual (in its dtype, not a float32 copy),
so the layer's next matmul and the kernel's backward read one saved buffer; the row
statistics are named ``STATS`` (float32, (B, T, H) elements: 1/64 of the output's at
head_dim 128 in bf16). A caller names neither again: a second name is a second saved copy.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

OUTPUT = "attention_out"
STATS = "attention_lse"


def kept_output(out: jax.Array) -> jax.Array:
    """The attention's output, named ``OUTPUT``: the value it returns and keeps."""
    return checkpoint_name(out, OUTPUT)


def kept_stats(stats):
    """Every leaf of ``stats`` (the log-sum-exp, or a kernel's own row statistics) named
    ``STATS``."""
    return jax.tree.map(lambda a: checkpoint_name(a, STATS), stats)
