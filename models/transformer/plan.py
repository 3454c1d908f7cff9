"""The recipe's train step built abstractly for any mesh and accelerator: what `shardkit plan
--verify K --target h100` compiles for the best K layouts, and what the target sweeps in
`tests/` and `bench/simulate.py` compile. Nothing is allocated: the state is
``step.abstract_state`` and the batch ``ShapeDtypeStruct``s; ``sk.cost.simulate`` then compiles
it in a subprocess with the target's compiler.

    shardkit plan --model 1b --devices 256 --hardware h100 --verify 3 --target h100
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx

import shardkit as sk

from .config import SIZES, Config
from .layouts import Layout, make_plan
from .model import PipelineSpec, Transformer, loss_fn, moe_loss_fn


def abstract_step(cfg: Config, mesh, *, global_batch: int, zero: int = 0, precision: str = "bf16",
                  sequence_parallel: bool = False, schedule: str = "gpipe", repeats: int = 1,
                  pipeline_microbatches: int | None = None, microbatches: int = 1, target: str = "cpu",
                  outer: sk.DiLoCo | None = None, offload: tuple[str, ...] = (),
                  layer_order: str = "natural", keep: str = "input",
                  gpu_memory_fraction: float | None = sk.xla.GPU_MEMORY_FRACTION):
    """``(step, abstract state, abstract batch)`` of the recipe (AdamW, clip 1.0) on ``mesh``.

    Args:
        cfg: the model.
        mesh: a mesh spec (``"data=8,tensor=8"``) or an ``AbstractMesh``.
        global_batch: sequences per step.
        zero, precision, sequence_parallel: as ``layouts.make_plan``.
        schedule, repeats, pipeline_microbatches: ``sk.pipeline``'s, with a ``pipe`` axis
            (default 2 microbatches per stage).
        microbatches: gradient-accumulation steps of the train step.
        target: whose devices the mesh holds (``sk.cost.TARGETS``): the model picks its
            attention and matmul forms for that platform (``sk.target_platform``).
        outer: ``sk.DiLoCo`` over the mesh's ``replica`` axis (the recipe's ``--diloco-every``).
        offload: ``sk.Plan``'s (the recipe's ``--offload opt_state``).
        layer_order: ``PipelineSpec.layer_order`` (``"stage-major"``: the layers stored as the
            schedule reads them; the abstract state's shapes are the same).
        keep: ``PipelineSpec.keep`` (what an explicit schedule keeps for its backward ops).
        gpu_memory_fraction: ``sk.train_step``'s (XLA:GPU's recompute limit, a share of the GPU).
    """
    amesh = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else sk.cost.abstract_mesh(mesh, target=target)
    cfg = cfg.replace(fp8=precision == "fp8")
    plan = make_plan(amesh, cfg, zero=zero, precision=precision, sequence_parallel=sequence_parallel, offload=offload)
    stages = amesh.shape.get("pipe", 1)
    pipe = PipelineSpec(pipeline_microbatches or 2 * stages, schedule, repeats, layer_order, keep) if stages > 1 else None
    objective = moe_loss_fn if cfg.moe_experts else loss_fn
    step = sk.train_step(plan, optax.adamw(3e-4), microbatches=microbatches, clip_norm=1.0, outer=outer,
                         gpu_memory_fraction=gpu_memory_fraction)(
        lambda model, batch: objective(model, batch, pipe))
    state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = {k: jax.ShapeDtypeStruct((global_batch, cfg.seq), np.int32) for k in ("inputs", "targets")}
    return step, state, batch


def layout_step(layout: Layout, cfg: Config, *, global_batch: int, target: str = "cpu", precision: str = "bf16",
                outer: sk.DiLoCo | None = None):
    """``abstract_step`` for one of the recipe's named layouts (``layouts.LAYOUTS``)."""
    return abstract_step(cfg, layout.mesh, global_batch=global_batch, zero=layout.zero, precision=precision,
                         sequence_parallel=layout.sequence_parallel, schedule=layout.schedule,
                         repeats=layout.repeats, target=target, outer=outer)


def builder(cfg: Config, *, global_batch: int, precision: str = "bf16",
            target: str = "cpu") -> Callable[[sk.cost.Layout], tuple]:
    """``search(..., build=)``: a cost-model ``Layout`` → the recipe's step on its mesh (its
    ZeRO stage, sequence parallelism, pipeline schedule, chunks, microbatches and ``keep``,
    remat policy; a ``context`` axis is in its mesh)."""
    def build(lo: sk.cost.Layout):
        model = cfg.replace(remat=lo.remat) if lo.remat != cfg.remat else cfg
        piped = lo.pipe > 1
        return abstract_step(model, lo.mesh, global_batch=global_batch, zero=lo.zero, precision=precision,
                             sequence_parallel=lo.sequence_parallel, schedule=lo.schedule, repeats=lo.repeats,
                             pipeline_microbatches=lo.microbatches if piped else None,
                             microbatches=1 if piped else lo.microbatches, target=target, keep=lo.keep)
    return build


def main(argv: list[str] | None = None) -> int:
    """``shardkit plan``: the analytic ranking, and with ``--verify K`` the best K layouts of the
    recipe compiled for ``--target`` (deviceless) and re-ranked by what that compiler says."""
    def build_for(size: str, global_batch: int, seq: int | None, precision: str, target: str):
        cfg = SIZES[size] if seq is None else SIZES[size].replace(seq=seq)
        return builder(cfg, global_batch=global_batch, precision=precision, target=target)

    return sk.cost.plan_main(list(argv or []), build_for=build_for)
