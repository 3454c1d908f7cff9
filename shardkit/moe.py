"""Mixture of experts with expert parallelism: ``sk.moe(x, router_logits, expert_fn, params)``.

Each token visits the ``top_k`` of ``E`` experts its router scores highest, and its output is
the gate-weighted sum of those experts' outputs (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch Transformer, Fedus et al. 2021). The experts' weights carry a leading ``E``
dimension sharded over the ``expert`` mesh axis; tokens travel to the devices that hold their
experts and back with two ``all_to_all``\\ s.

How it runs. Routing (softmax, top-k, gates, the auxiliary losses) is plain array code on the
global arrays, placed by the compiler. Dispatch, the experts and the combine run in a
``jax.shard_map`` manual over the expert axis and over the data-like axes the tokens are split
over (as ``sk.pipeline`` is manual over its axis and the data axes): every device then sorts
only its own tokens, and nothing but the all-to-all crosses devices. ``tensor`` (and any other
axis) stays with the compiler, so TP inside an expert (column/row-split weights) and ZeRO-3/FSDP
shards of the experts' other dimensions work as for any weight (FSDP shards are gathered at the
shard_map boundary, once per call). On a device, the tokens bound for expert ``e`` are written
into slots of a buffer ``(E, S, D)``; the all-to-all over ``expert`` hands each device the rows
of its ``E/n`` experts from every device, ``expert_fn`` runs on each local expert (``vmap``),
and the reverse all-to-all brings the outputs home, where each token gathers its ``k`` rows.
Without an expert axis (or of size 1) the same code runs without the all-to-all. Inside another
shard_map (``sk.pipeline``'s stages) the block runs under the compiler instead of in its own
shard_map: jax 0.10.2 cannot differentiate a shard_map nested there under a remat policy (the
residuals get shardings with the outer manual axis first). The result is the same; XLA then
decides how tokens and experts meet (no explicit all-to-all).

Capacity and the drop order. A *capacity group* is ``group_size`` consecutive tokens (default:
one sequence of a ``(B, T, D)`` input). Each expert takes at most ``C = ceil(capacity_factor ·
top_k · group_size / E)`` assignments from a group, in this order: every token's first choice
in token order, then every token's second choice, and so on (GShard's priority: a token loses
its 2nd expert before another token loses its 1st). An assignment past ``C`` is dropped: its
gate contributes nothing (the caller's residual carries the token). Groups are defined on the
tokens, not on devices, so any layout drops exactly the tokens one device drops; a device's
tokens must be whole groups. ``capacity_factor=None`` is dropless: ``C`` is the group size (an
expert can take every token of a group), and the group is a device's tokens (without drops the
grouping changes nothing).

Buffers and traffic. The all-to-all buffers are static: ``E · S`` rows per device with
``S = (tokens per device / group_size) · C``. With capacity factor ``c`` that is ``≈ c · k ·
tokens`` rows, so dispatch + combine, forward and backward move ``4 · c · k · tokens · D ·
bytes · (n-1)/n`` per device (``cost.analytic.from_shape.moe_traffic``). Dropless pads every expert to
the worst case (all of a device's tokens): ``E/k`` times the capacity-1 buffers, traffic and
expert flops. That padded form is the CPU path (XLA:CPU has no ragged-all-to-all: "HLO opcode
ragged-all-to-all is not supported by XLA:CPU") and the reference of the ragged one.

Dropless on GPU and TPU targets (``dispatch="auto"``, by ``sk.target_platform()``, the
platform compiled for) sends only the routed rows: assignments sorted by expert, counts
exchanged with an all_to_all, rows to their experts' devices and back with
``lax.ragged_all_to_all``, and the experts as grouped matmuls (``_moe_ragged.py``;
``kernels.grouped``: Megablox on TPU, a Mosaic GPU grouped GEMM on H100s). ``expert_fn`` is
re-evaluated with the stacked weights (``_grouped.py``): it must touch them only through
matmuls of the rows. The receive buffer is static, the worst case ``n · tokens · min(k, E/n)``
rows, but the collectives carry the ``k · tokens`` routed rows (BENCHMARKS.md, "Mixture of
experts", (d)).

Auxiliary outputs (``aux``): ``load_balance`` = E · Σ_i f_i · P_i (Switch Transformer eq. 4,
with f_i the share of the N·k assignments routed to expert i and P_i the mean router
probability; 1 when balanced), ``z_loss`` = mean over tokens of logsumexp(logits)² (ST-MoE,
Zoph et al. 2022), ``dropped_fraction`` (of the N·k assignments) and ``tokens_per_expert``
(assignments routed to each expert, before drops). The caller adds the losses it wants.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ._grouped import NotGroupable, grouped_expert
from ._moe_ragged import ragged_dispatcher, receive_rows, top_k_gates
from .mesh import block_shard_map, vmapped_axes
from ._axes import claim_axes
from .kernels.grouped import planning
from .plan import note
from .rules import path_str
from .xla import target_platform

_DATA_LIKE = ("replica", "data", "fsdp")  # as Plan's default batch axes
F32 = jnp.float32


def _placement(mesh, axis: str, batch_axes, manual, E: int, lead: tuple, g: int | None):
    """Where ``moe`` runs: the expert axis size ``n``, the token axes made manual with it and the
    token count ``N``; refuses an axis already manual, experts or tokens that do not split."""
    if axis in manual:
        raise ValueError(f"moe axis {axis!r} is already manual here (inside a shard_map over it); "
                         "call sk.moe outside that shard_map, or pass another axis=")
    sizes = {} if mesh is None else dict(mesh.shape)
    n = sizes.get(axis, 1)
    if E % n:
        raise ValueError(f"{E} experts do not split over the {axis!r} axis of size {n}: use a "
                         f"number of experts that is a multiple of {n}, or a smaller {axis!r} axis")
    tok_axes = _token_axes(mesh, axis, batch_axes, manual, n)
    if manual:
        # Inside another shard_map (sk.pipeline's stages) the block runs under the compiler,
        # without its own: jax 0.10.2 cannot differentiate a shard_map nested there (the
        # residuals get shardings that put the outer manual axis first: "Saw manual axis
        # 'expert' after free axis 'pipe'"). Same result; XLA places the expert axis.
        tok_axes, n = (), 1
    n_tok = math.prod(sizes[a] for a in tok_axes)
    N = math.prod(lead)
    if N % n_tok or (g is not None and (N // n_tok) % g):
        need = n_tok * (g or 1)
        raise ValueError(f"{N} tokens {tuple(lead)} do not split into whole capacity groups of "
                         f"{g or 1} over the token axes {tok_axes} ({n_tok} devices): need tokens % "
                         f"{need} == 0; change the batch, group_size or mesh")
    return n, tok_axes, N


def moe(x: jax.Array, router_logits: jax.Array, expert_fn: Callable[[Any, jax.Array], jax.Array],
        expert_params: Any, *, top_k: int = 2, capacity_factor: float | None = None,
        axis: str = "expert", renormalize: bool = True, group_size: int | None = None,
        batch_axes: str | tuple[str, ...] | None = None, mesh: Any = None,
        dispatch: str = "auto") -> tuple[jax.Array, dict]:
    """Routes each token to its ``top_k`` experts and returns the gate-weighted sum of their outputs.

    Args:
        x: tokens ``(N, D)`` or ``(B, T, D)``.
        router_logits: ``x``'s leading shape + ``(E,)``; softmax gives the router
            probabilities.
        expert_fn: ``expert_fn(params_of_one_expert, tokens_RxD) -> outputs_RxDo``, the expert
            (e.g. an MLP); it must treat rows independently (buffers hold padding rows).
        expert_params: pytree whose leaves have a leading dimension ``E``; shard it over
            ``axis`` with the plan (the other dimensions as any weight: TP, ZeRO/FSDP).
        top_k: experts per token, ``1 <= top_k <= E``.
        capacity_factor: ``None`` for dropless; else each expert takes at most
            ``ceil(capacity_factor · top_k · group_size / E)`` assignments per capacity group
            (module docstring: the drop order).
        axis: the mesh axis the experts are split over; absent or of size 1: all experts local.
        renormalize: divide the ``top_k`` gates by their sum (else the raw probabilities).
        group_size: tokens per capacity group; default ``T`` for a ``(B, T, D)`` input. Needed
            with ``capacity_factor`` for an ``(N, D)`` input.
        batch_axes: data-like mesh axes the tokens are split over (made manual with ``axis``);
            default: the active plan's batch axes, else the mesh's ``replica``/``data``/
            ``fsdp`` (those of size > 1 not already manual); ``()`` keeps them with the compiler.
        mesh: defaults to the ambient mesh (``jax.set_mesh``, as inside ``sk.train_step``).
        dispatch: ``"auto"``: dropless on a GPU or TPU target (``sk.target_platform()``) runs
            ``"ragged"`` (only the routed rows travel, ``lax.ragged_all_to_all``, and meet the
            weights, grouped matmuls: ``sk.kernels.grouped_matmul``) over an expert axis, and
            without one where every grouped matmul gets the target's kernel; everything else
            ``"padded"`` (the static ``(E, S, D)`` buffers). ``"ragged"`` needs
            ``capacity_factor=None`` and, with an expert axis, a GPU/TPU target. ``expert_fn`` must touch its weights only through matmuls of the
            rows (casts and transposes of the weights are fine), else ``"auto"`` warns
            (``RaggedFallbackWarning``) and pads.

    Returns:
        ``(y, aux)``: ``y`` of ``x``'s leading shape + ``(Do,)`` in ``x``'s dtype; ``aux`` a
        dict of float32 ``load_balance``, ``z_loss``, ``dropped_fraction`` (scalars) and
        ``tokens_per_expert`` ``(E,)``.

    Raises:
        ValueError: router logits of the wrong shape, ``top_k`` not in ``1..E``, expert params
            without a leading ``E`` dimension, ``E`` or the tokens not divisible by the mesh
            axes, a bad ``capacity_factor``/``group_size``/``dispatch``, or ``axis`` already
            manual.
    """
    lead = x.shape[:-1]
    E = _check_shapes(x, router_logits, expert_params, top_k)
    g = _group_size(x, capacity_factor, group_size)
    mesh = _resolve_mesh(mesh)
    manual = _manual_axes()
    n, tok_axes, N = _placement(mesh, axis, batch_axes, manual, E, lead, g)
    claim_axes(axis, *tok_axes)

    logits_NxE = router_logits.reshape(N, E).astype(F32)
    probs_NxE = jax.nn.softmax(logits_NxE, axis=-1)
    x_NxD = x.reshape(N, x.shape[-1])
    out = _out_dim(expert_fn, expert_params, x_NxD)
    n_tok = math.prod(dict(mesh.shape)[a] for a in tok_axes) if tok_axes else 1
    free = [a for a, s in ({} if mesh is None else dict(mesh.shape)).items()
            if s > 1 and a not in tok_axes and a not in manual]
    ragged = _ragged(dispatch, capacity_factor, n, bool(manual), expert_fn, expert_params, x_NxD,
                     rows=receive_rows(N // n_tok, top_k, E, n) if n > 1 else N // n_tok * top_k, free=free)
    if ragged:
        local = ragged_dispatcher(expert_fn, E, n, top_k, axis, out, renormalize)
    else:
        local = _dispatcher(expert_fn, E, n, top_k, capacity_factor, g, axis, out, renormalize,
                            whole=mesh if manual and len(free) > 1 else None)
    note("moe", {"experts": E, "top_k": top_k, "axis": axis, "axis_size": n, "token_axes": tok_axes,
                 "capacity_factor": capacity_factor, "group_size": g, "nested": bool(manual),
                 "dispatch": "ragged" if ragged else "padded"})
    if not tok_axes:
        y_NxD, idx_NxK, keep_NxK = local(x_NxD, probs_NxE, expert_params)
    else:
        tok = P(tok_axes if len(tok_axes) > 1 else tok_axes[0])
        wspecs = jax.tree.map(lambda _: P(axis) if n > 1 else P(), expert_params)
        # The grouped matmuls' Pallas kernels type no varying axes on their outputs.
        shard = block_shard_map(local, mesh=mesh, axis_names=tok_axes, in_specs=(tok, tok, wspecs),
                                out_specs=(tok, tok, tok), check_vma=not ragged)
        y_NxD, idx_NxK, keep_NxK = shard(x_NxD, probs_NxE, expert_params)
    routed_E = jnp.sum(jax.nn.one_hot(idx_NxK, E, dtype=F32), axis=(0, 1))
    aux = {
        "load_balance": E * jnp.sum(routed_E / (N * top_k) * jnp.mean(probs_NxE, axis=0)),
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits_NxE, axis=-1))),
        "dropped_fraction": 1.0 - jnp.mean(keep_NxK.astype(F32)),
        "tokens_per_expert": routed_E,
    }
    return y_NxD.reshape(lead + (out[0],)), aux


class RaggedFallbackWarning(UserWarning):
    """Dropless ``sk.moe`` on a GPU/TPU target padded its buffers: ``expert_fn`` cannot run as
    grouped matmuls (the message names the operation)."""


def _ragged(dispatch, capacity_factor, n, nested, expert_fn, expert_params, x_NxD, *, rows: int,
            free: list[str]) -> bool:
    """Whether the ragged dispatch runs (``moe``'s ``dispatch`` argument). ``"auto"`` takes it
    on a GPU/TPU target when an expert axis splits the experts (the routed rows travel, not
    ``E/k`` times them) or, without one, when every grouped matmul gets the target's kernel
    (where ``lax.ragged_dot`` would expand densely over the experts, padding is cheaper)."""
    if dispatch not in ("auto", "padded", "ragged"):
        raise ValueError(f"moe: dispatch={dispatch!r} must be 'auto', 'padded' or 'ragged'")
    platform = target_platform()
    if dispatch == "ragged":
        if capacity_factor is not None:
            raise ValueError("moe: dispatch='ragged' is dropless; pass capacity_factor=None (or "
                             "dispatch='padded' to keep the capacity)")
        if n > 1 and platform not in ("gpu", "tpu"):
            raise ValueError(f"moe: dispatch='ragged' over an expert axis of size {n} needs a GPU or TPU "
                             f"target (XLA:{platform.upper()} has no ragged-all-to-all); trace for one "
                             "(sk.cost target=) or use dispatch='auto'")
    elif dispatch == "padded" or capacity_factor is not None or nested or platform not in ("gpu", "tpu"):
        return False
    buffer = jax.ShapeDtypeStruct((rows, x_NxD.shape[-1]), x_NxD.dtype)
    try:
        with planning(free) as kernels:
            jax.eval_shape(lambda p, r: grouped_expert(expert_fn, p, r, jnp.zeros(
                jax.tree.leaves(p)[0].shape[0], jnp.int32)), expert_params, buffer)
    except NotGroupable as err:
        if dispatch == "ragged":
            raise ValueError(f"moe: dispatch='ragged': {err}") from err
        why = f"dropless sk.moe pads every expert's buffer on {platform}: {err}"
        warnings.warn(why, RaggedFallbackWarning, stacklevel=4)
        note("moe_fallback", why)
        return False
    dense = [why for kernel, why in kernels if kernel == "ragged_dot"]
    if dispatch == "auto" and n == 1 and dense:
        note("moe_fallback", f"dropless sk.moe pads on {platform}: without an expert axis the ragged "
                             f"form only pays with the grouped-matmul kernel, and {dense[0]}")
        return False
    return True


def expert_capacity(group_size: int, top_k: int, experts: int, capacity_factor: float | None) -> int:
    """Assignments one expert takes from one capacity group: ``ceil(c · k · g / E)``, at least
    1 and at most ``g`` (an expert sees each token once); dropless (``None``): ``g``."""
    if capacity_factor is None:
        return group_size
    return min(group_size, max(1, math.ceil(capacity_factor * top_k * group_size / experts)))


def _check_shapes(x, router_logits, expert_params, top_k) -> int:
    if x.ndim not in (2, 3):
        raise ValueError(f"moe: x must be (tokens, D) or (B, T, D), got shape {x.shape}")
    want = x.shape[:-1]
    if router_logits.ndim != x.ndim or router_logits.shape[:-1] != want:
        raise ValueError(f"moe: router_logits has shape {router_logits.shape} but x {x.shape} needs "
                         f"{want} + (E,): one row of E expert scores per token (e.g. x @ router "
                         "of shape (D, E))")
    E = router_logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"moe: top_k={top_k!r} must be an integer in 1..E={E} (router_logits "
                         f"{router_logits.shape} scores {E} experts)")
    flat = jax.tree_util.tree_flatten_with_path(expert_params)[0]
    if not flat:
        raise ValueError("moe: expert_params has no arrays; pass the experts' stacked weights")
    bad = [f"{path_str(k) or '<root>'} shape={tuple(jnp.shape(a))}" for k, a in flat
           if jnp.ndim(a) < 1 or jnp.shape(a)[0] != E]
    if bad:
        raise ValueError(f"moe: every expert_params leaf needs a leading dimension of E={E} experts "
                         f"(router_logits {router_logits.shape}); these do not:\n  - "
                         + "\n  - ".join(bad) + "\nFix: stack the experts' weights along a new "
                         "leading axis (jnp.stack, or nnx.vmap over the expert constructor)")
    return E


def _group_size(x, capacity_factor, group_size) -> int | None:
    if capacity_factor is None:
        if group_size is not None:
            raise ValueError("moe: group_size only applies with capacity_factor (dropless routing "
                             "drops nothing, whatever the groups)")
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"moe: capacity_factor={capacity_factor!r} must be a positive number, or "
                         "None for dropless routing")
    if group_size is None:
        if x.ndim == 2:
            raise ValueError(f"moe: capacity_factor with (tokens, D) input {x.shape} needs group_size= "
                             "(tokens per capacity group, e.g. the sequence length): the groups, not the "
                             "devices, decide which tokens drop")
        return x.shape[1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"moe: group_size={group_size!r} must be a positive integer")
    return group_size


def _resolve_mesh(mesh):
    context = jax.sharding.get_abstract_mesh()
    if context is not None and not context.empty:
        return context  # inside jit/shard_map the context mesh knows which axes are manual
    return mesh


def _manual_axes() -> set[str]:
    context = jax.sharding.get_abstract_mesh()
    if context is None or context.empty:
        return set()
    return {a for a, t in zip(context.axis_names, context.axis_types) if t == jax.sharding.AxisType.Manual}


def _token_axes(mesh, axis, batch_axes, manual, n) -> tuple[str, ...]:
    """Mesh axes the tokens are split over inside the shard_map: data-like ones, then ``axis``."""
    if mesh is None:
        return ()
    if batch_axes is None:
        from .plan import active_plan

        plan = active_plan()
        same = plan is not None and tuple(plan.mesh.axis_names) == tuple(mesh.axis_names)
        batch_axes = plan.batch_axes if same else _DATA_LIKE
    else:
        batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        bad = [a for a in batch_axes if a not in mesh.axis_names or a not in _DATA_LIKE]
        if bad:
            raise ValueError(f"moe: batch_axes {bad} must be data-like mesh axes {_DATA_LIKE}; the mesh "
                             f"has {dict(mesh.shape)}. Pass some of those, or () to leave the tokens' "
                             "data sharding to the compiler")
    mapped = vmapped_axes()  # a vmap's spmd axis (sk.DiLoCo's replicas) is not the tokens'
    return tuple(a for a in mesh.axis_names if a not in manual and a not in mapped and mesh.shape[a] > 1
                 and ((a in batch_axes and a in _DATA_LIKE) or (a == axis and n > 1)))


def _out_dim(expert_fn, expert_params, x_NxD) -> tuple[int, Any]:
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), expert_params)
    rows = jax.ShapeDtypeStruct((8, x_NxD.shape[-1]), x_NxD.dtype)
    y = jax.eval_shape(expert_fn, one, rows)
    if not hasattr(y, "shape") or y.ndim != 2 or y.shape[0] != 8:
        got = getattr(y, "shape", type(y).__name__)
        raise ValueError(f"moe: expert_fn(params_of_one_expert, tokens (R, {x_NxD.shape[-1]})) must "
                         f"return one array (R, D_out); for R=8 it returned {got}")
    return y.shape[1], y.dtype


def _dispatcher(expert_fn, E, n, k, capacity_factor, g, axis, out, renormalize, whole=None):
    """The per-device body: top-k, dispatch into ``(E, S, D)`` slots, all-to-all, experts,
    back. Top-k runs here, on a device's own tokens: XLA gathers a batch-sharded operand of
    its TopK. ``whole``: the mesh, when the body runs under the compiler inside another
    shard_map (``_placement``) with two or more compiler-owned axes: the slot buffers are
    then kept whole on every device (a sharding constraint; XLA gathers them over the
    expert axis), because XLA's partitioner aborts on the gather of a token's rows from a
    buffer split over the expert axis with its indices split too, inside a manual region
    with another compiler-owned axis beside it (jax 0.10.2, ``spmd_partitioner_util.cc:497``:
    ``sk.pipeline`` over pipe × expert × tensor; ``docs/upstream/``). So is the routing (tokens,
    probabilities, slots, rows, picked rows): every device computes the same indices, and no
    gather is left a token split to place. Left open, XLA:TPU split the combine's indices over
    ``expert`` and ``tensor`` and swapped them with a permute naming every device inside the
    explicit schedules' per-stage branch: a hang (``Report.hang_risks``; BENCHMARKS, issue 37)."""
    Do, _ = out
    E_loc = E // n
    if whole is None:
        keep_whole = lambda a: a  # noqa: E731
    else:
        keep_whole = lambda a: lax.with_sharding_constraint(a, jax.sharding.NamedSharding(whole, P()))  # noqa: E731

    def local(x_NxD, probs_NxE, params):
        N, D = x_NxD.shape
        x_NxD, probs_NxE = keep_whole(x_NxD), keep_whole(probs_NxE)
        gates_NxK, idx_NxK = top_k_gates(probs_NxE, k, renormalize)
        group = N if g is None else g
        G = N // group
        C = expert_capacity(group, k, E, capacity_factor)
        S = G * C
        # Priority within a group: all first choices in token order, then all second choices...
        e_GxKxg = jnp.swapaxes(idx_NxK.reshape(G, group, k), 1, 2)
        hot = jax.nn.one_hot(e_GxKxg.reshape(G, k * group), E, dtype=jnp.int32)
        pos_GxKg = jnp.sum((jnp.cumsum(hot, axis=1) - 1) * hot, axis=-1)
        pos_NxK = jnp.swapaxes(pos_GxKg.reshape(G, k, group), 1, 2).reshape(N, k)
        keep_NxK = pos_NxK < C
        group_N = jnp.arange(N, dtype=jnp.int32) // group
        slot_NxK = idx_NxK * S + group_N[:, None] * C + pos_NxK
        slot_NxK = keep_whole(jnp.where(keep_NxK, slot_NxK, E * S))  # out of range: dropped
        rows_NxKxD = keep_whole(jnp.broadcast_to(x_NxD[:, None, :], (N, k, D)))
        buf_EsxD = jnp.zeros((E * S, D), x_NxD.dtype)
        buf_EsxD = keep_whole(buf_EsxD.at[slot_NxK].add(rows_NxKxD, mode="drop"))
        buf_ExSxD = buf_EsxD.reshape(E, S, D)
        if n > 1:  # device j receives its E/n experts' slots from every device: (n·E_loc, S, D)
            buf_ExSxD = lax.all_to_all(buf_ExSxD, axis, 0, 0, tiled=True)
        xin = jnp.swapaxes(buf_ExSxD.reshape(n, E_loc, S, D), 0, 1).reshape(E_loc, n * S, D)
        y_loc = jax.vmap(expert_fn)(params, xin)  # (E_loc, n·S, Do)
        y_ExSxDo = jnp.swapaxes(y_loc.reshape(E_loc, n, S, Do), 0, 1).reshape(E, S, Do)
        if n > 1:  # back to the tokens' devices, in global expert order
            y_ExSxDo = lax.all_to_all(y_ExSxDo, axis, 0, 0, tiled=True)
        y_EsxDo = keep_whole(y_ExSxDo.reshape(E * S, Do))
        picked_NxKxDo = keep_whole(y_EsxDo.at[slot_NxK].get(mode="fill", fill_value=0))
        w_NxK = jnp.where(keep_NxK, gates_NxK, 0.0)
        y_NxDo = jnp.einsum("nk,nkd->nd", w_NxK, picked_NxKxDo.astype(F32))
        return y_NxDo.astype(x_NxD.dtype), idx_NxK, keep_NxK

    return local
