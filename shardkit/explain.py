"""``explain()``: what a compiled step costs per device — memory, collectives, flops.

Memory comes two ways: from the shard sizes of the state (exact bookkeeping) and from XLA's
``memory_analysis()`` of the compiled program (arguments, outputs, temporaries). Collectives are
read off the post-partitioning HLO and counted as executed: an op inside a ``while`` body (a
``lax.scan`` over layers or microbatches) counts ``known_trip_count`` times. The ``Report`` and
its reading of compiled programs are in ``shardkit/cost/compiled/report.py`` and ``executable.py``.
"""

from __future__ import annotations

import jax

from . import offload
from .cost.compiled.hlo import Collective as Collective, Traffic as Traffic, collectives_from_hlo as collectives_from_hlo
from .cost.compiled.executable import (compiled_memory as compiled_memory,
                                      report_from_compiled as report_from_compiled)
from .cost.compiled.report import Report as Report, shard_bytes as shard_bytes


def explain_step(step, state, batch, *, flops_per_token=None) -> Report:
    """The report behind ``TrainStep.explain``: compiled figures, and the analytic estimate
    of ``sk.cost.estimate_for_step`` beside them."""
    compiled = step.compile(state, batch)  # kept by the step: training on these shapes runs it
    plan = step.plan
    grad_specs = step.specs("grads")
    grads = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, plan.precision.grads, sharding=plan.sharding(s)),
        state.params, grad_specs)
    placed, _ = step.place_batch(batch)
    # Parameter and optimizer-state bytes as the compiled executable lays out its arguments.
    (state_sh, batch_sh), _ = compiled.input_shardings
    as_compiled = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    memory = {"params": shard_bytes(as_compiled(state.params, state_sh.params)),
              "opt_state": shard_bytes(as_compiled(state.opt_state, state_sh.opt_state)),
              "model_state": shard_bytes(state.model_state), "grads": shard_bytes(grads),
              "batch": shard_bytes(as_compiled(placed, batch_sh))}
    title = f"{plan!r}, microbatches={step.microbatches}"
    report = report_from_compiled(compiled, title, memory, plan.mesh, plan.batch_axes,
                                  pipeline=step.trace_notes.get("pipeline"))
    report.compiled_on = (f"this process's mesh {','.join(f'{a}={n}' for a, n in plan.mesh.shape.items())} "
                          f"({plan.mesh.size} {plan.mesh.devices.flat[0].platform} devices)")
    # Imported here: ``import shardkit`` stays light (the estimate's modules load on first use).
    from .cost.beside import add_estimate

    add_estimate(report, step, state, batch, flops_per_token=flops_per_token)
    offload.annotate(report, plan)
    return report
