"""Host offload: state that lives in pinned host memory between steps, and activations a
layer saves for its backward pass kept on the host.

Optimizer-state offload (ZeRO-Offload: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale
Model Training", USENIX ATC 2021; MaxText's ``optimizer_memory_host_offload``): with
``sk.Plan(..., offload=("opt_state",))`` the optimizer state keeps ZeRO's partition specs but
lives in ``pinned_host`` memory (``jax.sharding`` memory kinds). Inside the one compiled step
it is copied to the device once the gradients exist, updated there, and written back through
the step's output shardings. The copy waits for the gradients (``lax.optimization_barrier``),
so the state is not on the device during the forward and backward passes, whose activations
set the peak.

Activation offload: ``remat_policy("offload", names)`` is JAX's
``checkpoint_policies.save_and_offload_only_these_names``: the activations a layer tags with
``checkpoint_name`` are saved to pinned host memory instead of device memory, and everything
else is recomputed.

How much lives where is read off the compiled program: ``memory_analysis()``'s ``host_*``
bytes (``sk.Report.memory``'s ``host_*`` rows), which XLA:TPU, XLA:GPU (deviceless too) and
XLA:CPU all report for a program whose arguments carry memory kinds.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

KINDS = ("opt_state",)
HOST = "pinned_host"


def check(offload: Sequence[str] | str | None) -> tuple[str, ...]:
    """``Plan(offload=...)`` as a tuple of kinds.

    Raises:
        ValueError: a kind shardkit cannot offload (the valid ones are listed).
    """
    if offload is None:
        return ()
    kinds = (offload,) if isinstance(offload, str) else tuple(offload)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"Plan(offload=...) got {unknown}; what can live in host memory is {list(KINDS)} "
                         "(activations are offloaded by a remat policy: sk.offload.remat_policy('offload', names))")
    return tuple(dict.fromkeys(kinds))


def to_host(shardings):
    """The same shardings in pinned host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def to_device(tree, shardings, after):
    """``(after, tree)`` with ``tree`` (in host memory) copied to device memory by
    ``shardings`` (the same specs) once ``after`` (the gradients) is computed: the barrier ties
    the copy to them, so XLA cannot start it during the forward and backward passes and hold
    the state on the device through them."""
    after, tree = jax.lax.optimization_barrier((after, tree))
    device = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
    return after, jax.device_put(tree, device)


def remat_policy(names: Sequence[str] | None = None):
    """A ``jax.checkpoint`` policy that keeps a layer's saved activations in pinned host memory
    and recomputes the rest: with ``names``, the activations tagged with them
    (``jax.ad_checkpoint.checkpoint_name``: ``save_and_offload_only_these_names``); without,
    the outputs of matmuls with no batch dimensions, i.e. the weight-stationary projections
    (``offload_dot_with_no_batch_dims``: the offloading form of ``dots_with_no_batch_dims``).
    """
    cp = jax.checkpoint_policies
    if names is None:
        return cp.offload_dot_with_no_batch_dims("device", HOST)
    if isinstance(names, str) or not names:
        raise ValueError(f"remat_policy(names=...) takes a non-empty list of checkpoint_name tags, got {names!r}")
    return cp.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
                                                offload_src="device", offload_dst=HOST)


def annotate(report, plan) -> None:
    """Marks what ``plan`` offloads on ``report``, with a note where the compiled program shows
    no host bytes (the backend ignored the memory kinds: the figures are all device memory)."""
    report.offloaded = tuple(plan.offload)
    if plan.offload and report.estimate and "memory/peak" in report.estimate:
        report.caveats["memory/peak"] = (f"approximate: the estimate counts the offloaded {', '.join(plan.offload)} "
                                         "in device memory; the compiled peak holds it in host memory")
    if plan.offload and "host_peak" not in report.memory:
        report.notes.append(f"offload={plan.offload} was asked for, but the compiled program reports no host "
                            "memory: this backend placed everything in device memory")


__all__ = ["KINDS", "annotate", "check", "remat_policy", "to_device", "to_host"]
