"""Where the transformer's logical axes live: one table, filtered by the mesh at hand.

``RULES`` says, for every logical axis the model names, which mesh axis it goes to when the
mesh has that axis:

* ``batch`` over the data-like axes (DP, and FSDP's batch split);
* ``embed`` over ``fsdp``: every weight has an embed dim, so this alone is FSDP (weights,
  their gradients and Adam moments sharded, gathered layer by layer in the scan);
* ``heads``/``kv_heads``/``mlp``/``vocab`` over ``tensor``: Megatron TP — q/k/v and the MLP's
  gate/up split by columns, the attention output and the MLP's down projection by rows, the
  embedding/head by vocabulary;
* ``seq`` over ``tensor`` only with sequence parallelism: the residual stream, norms and
  adds run on sequence shards between the TP regions (Korthikanti et al. 2022);
* ``layers`` over ``pipe``: the stacked layer weights, run by ``sk.pipeline``;
* ``expert`` over ``expert``: the MoE layers' expert weights (``sk.moe``). The batch is
  split over ``expert`` too (each device routes its own tokens), so ZeRO shards state over it
  as over a data axis, expert weights over the data axes they do not use already;
* ``seq`` and ``context`` over ``context``: context parallelism splits every activation's
  sequence dim and attention runs as ``sk.context_attention`` (a ring over the axis); the
  loss reorders the batch once into the zig-zag order that balances the causal work.

A layout is then just a mesh (plus ZeRO stage and the sequence-parallel switch); ``LAYOUTS``
names the ones the tests, snapshots and benchmark use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import shardkit as sk

from .config import Config

DATA_AXES = ("replica", "data", "fsdp")

RULES: dict[str, tuple[str, ...]] = {
    "batch": DATA_AXES + ("expert",),
    "seq": ("context",),  # ("context", "tensor") under sequence parallelism
    "context": ("context",),  # attention's and the MLP's sequence dim (sk.context_attention)
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "layers": ("pipe",),
    "expert": ("expert",),
}
# Expert parallelism splits the batch too: the experts' devices each route their own tokens.
BATCH_AXES = DATA_AXES + ("expert",)
# Every mesh axis the rules use: what `--mesh` accepts.
MESH_AXES = tuple(dict.fromkeys(DATA_AXES + tuple(a for axes in RULES.values() for a in axes)))


def axis_rules(mesh_shape: Mapping[str, int], cfg: Config | None = None, *,
               sequence_parallel: bool = False, vocab_parallel: bool = True) -> sk.AxisRules:
    """``RULES`` restricted to the axes of a mesh.

    Args:
        mesh_shape: ``mesh.shape`` (axis → size).
        cfg: the model; when its ``kv_heads`` do not divide the tensor axis, K/V projections
            are replicated over it (every TP rank keeps all kv heads) instead of failing.
        sequence_parallel: shard the residual stream's sequence dim over ``tensor``.
        vocab_parallel: shard the embedding/head's vocabulary over ``tensor`` (on by default;
            every layout keeps it, the explicit pipeline schedules on data×pipe×tensor too:
            XLA's old abort on a vocab-sharded head in the 1F1B loss branch is gone since the
            pipeline's data axes are manual).
    """
    table = dict(RULES)
    if not vocab_parallel:
        table["vocab"] = ()
    if sequence_parallel:
        table["seq"] = ("context", "tensor")
    if cfg is not None and cfg.kv_heads % mesh_shape.get("tensor", 1):
        table["kv_heads"] = ()
    out = {name: tuple(a for a in axes if a in mesh_shape) for name, axes in table.items()}
    return sk.AxisRules({name: axes or None for name, axes in out.items()})


@dataclass(frozen=True)
class Layout:
    """A named layout: a mesh, a ZeRO stage, sequence parallelism, pipeline settings.

    Attributes:
        mesh: ``sk.make_mesh`` spec.
        zero: ZeRO stage over the data axes.
        sequence_parallel: see ``axis_rules``.
        schedule: pipeline schedule when the mesh has a ``pipe`` axis.
        repeats: layer chunks per stage (circular, interleaved-1f1b).
    """

    mesh: str
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "gpipe"
    repeats: int = 1
    vocab_parallel: bool = True


LAYOUTS: dict[str, Layout] = {
    "dp": Layout("data=8"),
    "zero1": Layout("data=8", zero=1),
    "zero3": Layout("data=8", zero=3),
    "fsdp": Layout("fsdp=8"),
    "tp": Layout("data=4,tensor=2"),
    "fsdp_tp": Layout("fsdp=4,tensor=2"),
    "tp_sp": Layout("data=4,tensor=2", sequence_parallel=True),
    "pp_gpipe": Layout("data=4,pipe=2", zero=1),
    "pp_circular": Layout("data=4,pipe=2", zero=1, schedule="circular", repeats=2),
    "pp_1f1b": Layout("data=4,pipe=2", zero=1, schedule="1f1b"),
    "tp_pp": Layout("tensor=2,pipe=4"),
    "dp_pp_tp": Layout("data=2,pipe=2,tensor=2"),
    "dp_pp_tp_1f1b": Layout("data=2,pipe=2,tensor=2", schedule="1f1b"),
    # Zero-bubble (backward split into input and weight gradients) and interleaved 1F1B.
    "pp_zb": Layout("data=4,pipe=2", zero=1, schedule="zb-h1"),
    "pp_interleaved": Layout("data=4,pipe=2", zero=1, schedule="interleaved-1f1b", repeats=2),
    "dp_pp_tp_zb": Layout("data=2,pipe=2,tensor=2", schedule="zb-h1"),
    "hybrid": Layout("data=2,fsdp=2,tensor=2", sequence_parallel=True),
    # Mixture of experts (Config.moe_experts > 0): experts over `expert`, with DP, TP inside
    # each expert, FSDP, and a pipeline.
    "ep": Layout("expert=8"),
    "ep_dp": Layout("data=2,expert=4", zero=1),
    "ep_tp": Layout("expert=4,tensor=2"),
    "ep_fsdp": Layout("fsdp=2,expert=4"),
    "ep_pp": Layout("expert=4,pipe=2"),
    # Context parallelism: the sequence split over `context` (ring attention), with TP, with
    # DP and FSDP, and inside pipeline stages.
    "cp": Layout("context=8"),
    "cp_tp": Layout("context=4,tensor=2"),
    "dp_cp_fsdp": Layout("data=2,context=2,fsdp=2"),
    "cp_pp": Layout("context=2,pipe=2,data=2"),
    # Two compiler-owned axes beside an explicit pipeline schedule (the 4D layout of long
    # context, and MoE with TP inside a pipeline).
    "cp_tp_pp": Layout("pipe=2,context=2,tensor=2", schedule="1f1b"),
    "ep_tp_pp": Layout("pipe=2,expert=2,tensor=2", schedule="1f1b"),
}


def make_plan(mesh, cfg: Config, *, zero: int = 0, precision: str = "fp32",
              sequence_parallel: bool = False, vocab_parallel: bool = True, offload: tuple[str, ...] = ()) -> sk.Plan:
    """The ``sk.Plan`` for the transformer on ``mesh`` (``offload``: ``sk.Plan``'s)."""
    rules = axis_rules(mesh.shape, cfg, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    batch = tuple(a for a in mesh.axis_names if a in BATCH_AXES)
    return sk.Plan(mesh, axis_rules=rules, zero=zero, precision=precision, batch_axes=batch, offload=offload)
