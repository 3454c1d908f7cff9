"""fp8 matmuls with per-tensor delayed scaling (Micikevicius et al., "FP8 Formats for Deep
Learning", 2022; the delayed scaling of NVIDIA Transformer Engine).

``fp8_einsum(spec, x, kernel, meta)`` runs one matmul with both operands in E4M3 (4 exponent
bits, 3 mantissa bits: the forward's precision) and, in the backward pass, the incoming
gradient in E5M2 (5 exponent bits: the gradients' range). Each of the three tensors has its
own scale, taken from the largest magnitude it had over the last ``history`` steps (its *amax
history*) so that the largest recent value lands at the format's largest finite number: the
scale of step t needs nothing computed in step t, and the matmul is one fp8 GEMM.

The histories are parameters of kind ``Fp8Meta`` (an ``nnx.Param`` with
``overwrite_with_gradient``): their "gradient" is their new value — the history rolled by one
with this step's amax in front, computed where the tensor is (the gradient's in the backward
pass). ``sk.train_step`` writes that value over the parameter instead of handing it to the
optimizer, takes the max (not the mean) over microbatches, and leaves it out of the gradient
norm and clipping. So the histories live in ``TrainState.params``, replicated (ZeRO does not
shard them), donated and checkpointed with everything else.

Each amax is a max over the whole tensor, so where the tensor is sharded it crosses devices.
Every scale is read from the histories as they came into the step (the gradient's too), so the
amaxes feed nothing but the new histories: their reductions depend on no other one. Inside
``sk.train_step`` they also leave every loop unreduced: the step's loss hands each model an
``Fp8History`` (``with_row_grid``: the histories beside a zero *row grid* split over the
batch's mesh axes), and a matmul's cotangent for it is each tensor's amax per block of rows of
its leading dimension — each device reduces its own rows, with no communication, also in the
body of a layer ``lax.scan``, whose per-layer cotangents carry the grid out of the loop. The
max over the row blocks is taken once, after the loops, where XLA combines every history's
into one all-reduce per step (per microbatch). The values are the same maxes (a max of block
maxes). Called on a plain history array (outside a step, or on a mesh with no batch axes),
``fp8_einsum`` takes the whole-tensor max itself: one all-reduce per call where sharded, which
XLA combines in straight-line code but not across a loop's iterations.

``Fp8Dot`` is the NNX module that owns one matmul's three histories. Masters stay f32 and
everything but the matmuls runs in the compute dtype (``precision="fp8"``: bf16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .xla import target_platform

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HISTORY = 16
F32 = jnp.float32


class Fp8Meta(nnx.Param):
    """An fp8 amax history: a parameter whose gradient is its new value (``sk.train_step``
    overwrites it, never optimizes it)."""

    overwrite_with_gradient = True


def _scale(history: jax.Array, dtype) -> jax.Array:
    """The delayed scale: the history's largest amax maps to ``dtype``'s largest finite number
    (1 while the history is empty or not finite)."""
    amax = jnp.max(history.astype(F32))
    fmax = jnp.asarray(jnp.finfo(dtype).max, F32)
    return jnp.where((amax > 0) & jnp.isfinite(amax), amax / fmax, 1.0)


def _quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x / scale``, clipped to the format's range (a value above the delayed amax saturates
    instead of overflowing), rounded to ``dtype``."""
    fmax = jnp.finfo(dtype).max.astype(F32)
    return jnp.clip(x.astype(F32) / scale, -fmax, fmax).astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
    """``x``'s largest magnitude, f32: a global max, one small all-reduce where ``x`` is sharded."""
    # In f32 whatever x's dtype (exactly the same max): the step's amaxes are of one type, so
    # only a dependency could keep XLA from combining their all-reduces.
    return jnp.max(jnp.abs(x.astype(F32)))


def _push(histories: jax.Array, amaxes: jax.Array) -> jax.Array:
    """The ``(..., 3, history)`` histories rolled by one step, ``amaxes`` (..., 3) in front."""
    return jnp.concatenate([amaxes[..., None].astype(histories.dtype), histories[..., :-1]], axis=-1)


@jax.tree_util.register_pytree_node_class
class Fp8History:
    """An ``Fp8Meta``'s value inside ``sk.train_step``'s loss: the histories as they came in
    (``(..., 3, history)``, replicated) beside two zero grids whose cotangents are this step's
    amaxes per block, reduced where each block is (``with_row_grid``): ``rows``, ``(..., 2,
    n)``, split over the batch's mesh axes (``n`` their size), x's and the gradient's amax per
    block of rows; ``blocks``, ``(..., n, n)``, laid out as XLA places the kernel, its amax per
    block of its first two dimensions that split into ``n``.

    Indexing and iterating index all three along the leading (layer) dims, as on the history
    array itself, so a model that slices its stacked histories (``lax.scan``, a Python loop)
    runs unchanged."""

    def __init__(self, history, rows, blocks):
        self.history, self.rows, self.blocks = history, rows, blocks

    def tree_flatten(self):
        return (self.history, self.rows, self.blocks), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __getitem__(self, index):
        return Fp8History(self.history[index], self.rows[index], self.blocks[index])

    def __len__(self):
        return len(self.history)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def shape(self):
        return self.history.shape

    @property
    def ndim(self):
        return self.history.ndim

    @property
    def dtype(self):
        return self.history.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def with_row_grid(history: jax.Array, rows_sharding) -> Fp8History:
    """``history`` with its zero grids beside it (``sk.train_step`` applies it to every
    ``Fp8Meta`` in its loss). Its gradient is ``history`` rolled by one with each tensor's
    amax, the max over its blocks, in front: one max across devices per step, after every
    loop, where XLA combines all of them into one all-reduce.

    ``rows_sharding``: the row grid's ``NamedSharding`` (the batch's axes on its last
    dimension). The kernel's grid is left to XLA: a layout asked for there would be
    propagated into the kernel's quantization (the rows of a replicated kernel, quantized
    where they are, then gathered for the GEMM)."""
    axes = rows_sharding.spec[-1]
    n = int(np.prod([rows_sharding.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
    rows = jnp.zeros(history.shape[:-2] + (2, n), F32)
    blocks = jnp.zeros(history.shape[:-2] + (n, n), F32)
    return Fp8History(history, jax.lax.with_sharding_constraint(rows, rows_sharding), blocks)


def _with_row_grid_fwd(history, rows_sharding):
    return with_row_grid(history, rows_sharding), history


def _with_row_grid_bwd(rows_sharding, history, ct):
    rows = jnp.max(ct.rows, axis=-1)
    amaxes = jnp.stack([rows[..., 0], jnp.max(ct.blocks, axis=(-2, -1)), rows[..., 1]], axis=-1)
    return (_push(history, amaxes),)


with_row_grid.defvjp(_with_row_grid_fwd, _with_row_grid_bwd)


def _row_amaxes(x: jax.Array, n: int) -> jax.Array:
    """``x``'s largest magnitude in each of ``n`` blocks of rows of its leading dimension,
    ``(n,)``: where the rows are split over the batch's ``n`` devices, each device reduces its
    own rows, with no communication. A tensor whose leading dimension does not split into
    ``n`` blocks (or a scalar) gives its global amax in every slot (an all-reduce where it is
    sharded)."""
    if x.ndim and x.shape[0] % n == 0:
        blocks = jnp.abs(x.astype(F32)).reshape((n, x.shape[0] // n) + x.shape[1:])
        return jnp.max(blocks, axis=tuple(range(1, blocks.ndim)))
    return jnp.broadcast_to(_amax(x), (n,))


def _block_amaxes(kernel: jax.Array, n: int) -> jax.Array:
    """``kernel``'s largest magnitude per block, ``(n, n)``: its first two dimensions that
    split into ``n`` blocks each (a missing one broadcast), the rest reduced whole. Whichever
    of those two ZeRO splits over the batch's devices, each device reduces its own blocks."""
    split = [d for d in range(kernel.ndim) if kernel.shape[d] % n == 0][:2]
    shape = []
    for d, size in enumerate(kernel.shape):
        shape += [n, size // n] if d in split else [size]
    blocks = jnp.abs(kernel.astype(F32)).reshape(shape)
    keep = [split.index(d) + d for d in split]  # where each split dimension's n lands
    out = jnp.max(blocks, axis=tuple(i for i in range(len(shape)) if i not in keep))
    return jnp.broadcast_to(out.reshape(out.shape + (1,) * (2 - out.ndim)), (n, n))


def _history(meta) -> jax.Array:
    """The ``(3, history)`` histories, from a plain array or an ``Fp8History``."""
    return meta.history if isinstance(meta, Fp8History) else meta


def _transposed(spec: str) -> tuple[str, str]:
    """The einsum specs of the two input gradients of ``spec`` (``"ab,bc->ac"``)."""
    ins, out = spec.replace(" ", "").split("->")
    lhs, rhs = ins.split(",")
    for name, operand, other in (("first", lhs, rhs), ("second", rhs, lhs)):
        lost = set(operand) - set(out) - set(other)
        if lost:
            raise ValueError(f"fp8_einsum({spec!r}): the {name} operand's indices {sorted(lost)} are summed "
                             "within it; sum them before the matmul")
    return f"{out},{rhs}->{lhs}", f"{lhs},{out}->{rhs}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x: jax.Array, kernel: jax.Array, meta: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, kernel)`` as one fp8 matmul, result in ``x``'s dtype.

    Args:
        spec: a two-operand einsum spec (``"btd,df->btf"``).
        x: the activations (E4M3 in the matmul).
        kernel: the weights (E4M3).
        meta: ``(3, history)`` amax histories of x, kernel and the output's gradient (E5M2),
            or, inside ``sk.train_step``, an ``Fp8History`` holding them.

    Its gradient with respect to ``meta`` is the new histories, or for an ``Fp8History`` the
    row blocks' amaxes that ``with_row_grid`` turns into them (see the module docstring).
    """
    return _forward(spec, x, kernel, meta)[0]


def _dot(spec: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """An fp8 GEMM writing ``dtype`` (bf16: what the GPU's fp8 GEMM writes, and what gradients
    are then reduced in across devices), times the operands' scales. XLA:CPU is asked for f32
    and casts after (as the recipe's bf16 dots: ``Precision``'s note)."""
    out = F32 if target_platform() == "cpu" else dtype
    return (jnp.einsum(spec, a, b, preferred_element_type=out) * scale.astype(out)).astype(dtype)


def _forward(spec, x, kernel, meta):
    _transposed(spec)  # a spec the backward pass cannot transpose fails here, at trace time
    sx, sk = _scale(_history(meta)[0], E4M3), _scale(_history(meta)[1], E4M3)
    qx, qk = _quantize(x, sx, E4M3), _quantize(kernel, sk, E4M3)
    return _dot(spec, qx, qk, sx * sk, x.dtype), (qx, qk, sx, sk, x, kernel, meta)


def _fwd(spec, x, kernel, meta):
    y, (qx, qk, sx, sk, x, kernel, meta) = _forward(spec, x, kernel, meta)
    # Every scale comes from the histories as they came in (the gradient's too), never from
    # this step's amaxes, which then feed only the new histories: their all-reduces depend on
    # no other one and XLA combines them (the module docstring). Reading the gradient's scale
    # off the updated histories chained each gradient to the forward's all-reduces: four
    # all-reduces per layer of the 7B instead of one (BENCHMARKS.md, "fp8 on H100s").
    sg = _scale(_history(meta)[2], E5M2)
    if isinstance(meta, Fp8History):  # amaxes per block, reduced after the loops
        n = meta.rows.shape[-1]
        amaxes = (_row_amaxes(x, n), _block_amaxes(kernel, n))
    else:
        amaxes = jnp.stack([_amax(x), _amax(kernel)])
    # The output is in x's dtype, so is its gradient g; a scalar carries the kernel's dtype.
    return y, (qx, qk, sx, sk, sg, meta, amaxes, jnp.zeros((), kernel.dtype))


def _bwd(spec, res, g):
    qx, qk, sx, sk, sg, meta, amaxes, k_zero = res
    x_dtype, k_dtype = g.dtype, k_zero.dtype
    dx_spec, dk_spec = _transposed(spec)
    qg = _quantize(g, sg, E5M2)
    dx = _dot(dx_spec, qg, qk, sg * sk, x_dtype)
    dk = _dot(dk_spec, qx, qg, sx * sg, k_dtype)
    if isinstance(meta, Fp8History):
        rows = jnp.stack([amaxes[0], _row_amaxes(g, meta.rows.shape[-1])])
        return dx, dk, Fp8History(jnp.zeros_like(meta.history), rows, amaxes[1])
    return dx, dk, _push(meta, jnp.concatenate([amaxes, _amax(g)[None]]))


fp8_einsum.defvjp(_fwd, _bwd)


class Fp8Dot(nnx.Module):
    """One matmul's fp8 state: ``Fp8Dot()(spec, x, kernel)`` is ``fp8_einsum`` with this
    module's amax histories (``self.meta``: ``(3, history)``, replicated: a few floats)."""

    def __init__(self, history: int = HISTORY):
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"Fp8Dot(history={history!r}): the amax history needs at least one step")
        # Named (None, None) so plans resolve it as replicated without a rule; not sharded at
        # construction (Flax's eager sharding), which would need a mesh in scope: a model built
        # eagerly and handed to step.init is laid out there, like one built inside it.
        self.meta = Fp8Meta(jnp.zeros((3, history), F32), out_sharding=(None, None), eager_sharding=False)

    def __call__(self, spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
        return fp8_einsum(spec, x, kernel, self.meta[...])


def is_meta(variable) -> bool:
    """Whether an NNX variable is one ``sk.train_step`` overwrites with its gradient."""
    return bool(getattr(type(variable), "overwrite_with_gradient", False))


__all__ = ["E4M3", "E5M2", "HISTORY", "Fp8Dot", "Fp8History", "Fp8Meta", "fp8_einsum", "is_meta", "with_row_grid"]
