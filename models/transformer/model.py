"""A GPT-style decoder in Flax NNX, written to be sharded by names.

Pre-norm blocks (RMSNorm → causal self-attention with rotary positions and optional
grouped-query heads → RMSNorm → SwiGLU MLP), tied or untied embeddings. The blocks are built
once with ``nnx.vmap`` into one stacked module (every block weight has a leading ``layers``
dim) and run with ``lax.scan``, so compile time does not grow with depth; under a ``pipe``
mesh axis the same stacked weights go to ``sk.pipeline`` instead.

Every parameter names its logical axes (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``layers``) and key activations are constrained with ``sk.constrain``
(``batch``, ``seq``, ``heads``, ``mlp``, ``vocab``); ``models.transformer.layouts`` maps the
names to mesh axes. Outside a shardkit plan the constraints are no-ops.

The attention layer lives in ``attention.py`` and the shared pieces (named matmuls, RMSNorm,
sequence-parallel gathers) in ``layers.py``; this module builds the MLP, MoE, block, stack and
losses on them.

Shape letters: B batch, T sequence, D d_model, H heads, K kv heads, G = H/K, Q head_dim,
F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import shardkit as sk

from .attention import Attention, context_size, rotary
from .config import Config
from .layers import (F32, Dots, RMSNorm, _dot, _param, constrain, gather_output_gradient, gather_region_input,
                     rms_norm)


# Schedules whose pipeline returns activations (backward by autodiff); the others take the
# loss inside the pipeline.
AUTODIFF_SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """How to run the layer stack over the ``pipe`` mesh axis with ``sk.pipeline``.

    Attributes:
        microbatches: microbatches per step (the batch is split along its leading dim).
        schedule: ``"gpipe"``, ``"circular"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zb-h1"`` or ``"zb-v"`` (the last four run their backward inside the pipeline).
        repeats: layer chunks per stage (``"circular"``, ``"interleaved-1f1b"``).
        layer_order: ``"natural"``, or ``"stage-major"``: the model's stacked layers are
            stored in the order the schedule reads them (``sk.pipeline_layer_order``; its
            checkpoints hold that order), so the step moves no weights.
        keep: ``sk.pipeline``'s ``keep`` (explicit schedules): ``"input"``, ``"all"``,
            ``"dots"`` or ``"lean"`` (the layer names its residuals ``sk.LEAN_RESIDUALS``).
    """

    microbatches: int = 4
    schedule: str = "gpipe"
    repeats: int = 1
    layer_order: str = "natural"
    keep: str = "input"


class MLP(nnx.Module):
    """SwiGLU: gate/up split by columns, down by rows, one reduction after (Megatron)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.gate = _param(rngs, (D, F), ("embed", "mlp"), cfg.init_std)
        self.up = _param(rngs, (D, F), ("embed", "mlp"), cfg.init_std)
        self.down = _param(rngs, (F, D), ("mlp", "embed"), out_std)
        self.dots = Dots(cfg, ("gate", "up", "down"))

    def __call__(self, x_BxTxD):
        x_BxTxD = gather_region_input(x_BxTxD)
        gate_BxTxF = self.dots("gate", "btd,df->btf", x_BxTxD, self.gate[...])
        up_BxTxF = self.dots("up", "btd,df->btf", x_BxTxD, self.up[...])
        # SwiGLU's backward needs gate and up; the product is recomputed from them.
        gate_BxTxF, up_BxTxF = checkpoint_name(gate_BxTxF, "mlp_gate"), checkpoint_name(up_BxTxF, "mlp_up")
        h_BxTxF = constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, ("batch", "context", "mlp"))
        return gather_output_gradient(self.dots("down", "btf,fd->btd", h_BxTxF, self.down[...]))


class MoE(nnx.Module):
    """Mixture of SwiGLU experts (``sk.moe``): a router scores ``moe_experts`` experts per
    token and each token runs through its ``moe_top_k`` best, weighted by their gates. Expert
    weights carry a leading ``expert`` dim (split over the ``expert`` mesh axis); inside an
    expert, gate/up split by columns and down by rows over ``tensor``, as in ``MLP``.
    Returns ``(y, router stats)``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        D, F, E = cfg.d_model, cfg.d_ff, cfg.moe_experts
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.router = _param(rngs, (D, E), ("embed", None), cfg.init_std)
        self.gate = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.up = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.down = _param(rngs, (E, F, D), ("expert", "mlp", "embed"), out_std)
        self.top_k, self.capacity = cfg.moe_top_k, cfg.moe_capacity

    def __call__(self, x_BxTxD):
        logits_BxTxE = jnp.einsum("btd,de->bte", x_BxTxD, self.router[...], preferred_element_type=F32)
        experts = {"gate": self.gate[...], "up": self.up[...], "down": self.down[...]}
        return sk.moe(x_BxTxD, logits_BxTxE, swiglu_expert, experts, top_k=self.top_k,
                      capacity_factor=self.capacity)


def swiglu_expert(p: dict, x_RxD: jax.Array) -> jax.Array:
    """One expert's SwiGLU on the R token rows sent to it."""
    gate_RxF = _dot("rd,df->rf", x_RxD, p["gate"])
    up_RxF = _dot("rd,df->rf", x_RxD, p["up"])
    h_RxF = constrain(jax.nn.silu(gate_RxF) * up_RxF, (None, "mlp"))
    return _dot("rf,fd->rd", h_RxF, p["down"])


class Block(nnx.Module):
    """One pre-norm decoder layer. The residual stream is constrained to
    ("batch", "seq", None): under sequence parallelism "seq" maps to the tensor axis, so
    norms and residual adds run on sequence shards. An MoE block returns ``(x, router stats)``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
        self.dropout = cfg.dropout

    def __call__(self, x_BxTxD, cos_TxQ2, sin_TxQ2, rng: jax.Array | None = None):
        keys = (None, None) if rng is None else jax.random.split(rng)
        attn_BxTxD = self.attn(self.attn_norm(x_BxTxD), cos_TxQ2, sin_TxQ2)
        x_BxTxD = x_BxTxD + dropout(attn_BxTxD, self.dropout, keys[0])
        # sequence-split under SP: the MLP's norm and its gather are recomputed from it
        x_BxTxD = checkpoint_name(constrain(x_BxTxD, ("batch", "seq", None)), "residual")
        mlp = self.mlp(self.mlp_norm(x_BxTxD))
        mlp_BxTxD, aux = mlp if isinstance(mlp, tuple) else (mlp, None)
        x_BxTxD = x_BxTxD + dropout(mlp_BxTxD, self.dropout, keys[1])
        x_BxTxD = constrain(x_BxTxD, ("batch", "seq", None))
        return x_BxTxD if aux is None else (x_BxTxD, aux)


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout: zeroes a ``rate`` fraction and scales the rest by 1/(1 - rate); the
    identity without ``rng`` (evaluation) or at rate 0. The mask is drawn for the whole
    (global) array, so it does not depend on how the array is sharded."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    policies = {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        "offload": sk.offload.remat_policy(),  # as dots_no_batch, saved in pinned host memory
        "lean": sk.lean_policy(),  # the values named sk.LEAN_RESIDUALS: matmul outputs, no norm
    }
    return jax.checkpoint(fn, policy=policies[policy])


class Transformer(nnx.Module):
    """The decoder: ``model(tokens_BxT) -> logits_BxTxV`` (float32)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab, cfg.d_model), ("vocab", "embed"), cfg.init_std)

        def stack(count: int, moe: bool):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_blocks(rngs):
                return Block(cfg, rngs=rngs, moe=moe)

            return stacked_blocks(rngs)

        # Experts every N-th layer (N > 1): a stack of dense blocks and one of MoE blocks,
        # run as L/N groups of N - 1 dense layers and one MoE layer.
        n_moe = cfg.layers // cfg.moe_every if cfg.moe_experts else 0
        self.blocks = stack(cfg.layers - n_moe or n_moe, moe=n_moe == cfg.layers)
        if 0 < n_moe < cfg.layers:
            self.moe_blocks = stack(n_moe, moe=True)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"), cfg.init_std)

    def layer_fn(self, T: int, with_aux: bool = False):
        """``(one layer's params, x_BxTxD) -> x_BxTxD`` for a sequence of length T, remat
        applied; the same function drives ``lax.scan`` and ``sk.pipeline`` stages. With MoE
        layers every ``moe_every``-th layer, one "layer" here is such a group
        (``layer_params``); ``with_aux`` returns ``(x, router stats or None)``."""
        graphdef, _ = nnx.split(self.blocks)
        moe_def = nnx.split(self.moe_blocks)[0] if hasattr(self, "moe_blocks") else None
        cos_TxQ2, sin_TxQ2 = rotary(T, self.cfg.head_dim, self.cfg.rope_theta)
        # Under context parallelism the tokens arrive in zig-zag order (loss_fn): so do the
        # positions RoPE rotates by.
        cos_TxQ2, sin_TxQ2 = sk.context_shard((cos_TxQ2, sin_TxQ2), seq_dim=0)
        N = self.cfg.moe_every

        def block(gd, params, x_BxTxD, rng):
            out = nnx.merge(gd, params)(x_BxTxD, cos_TxQ2, sin_TxQ2, rng)
            return out if isinstance(out, tuple) else (out, None)

        def layer(params, x_BxTxD, rng=None):
            if moe_def is None:
                x_BxTxD, aux = block(graphdef, params, x_BxTxD, rng)
            else:
                keys = [None] * N if rng is None else [jax.random.fold_in(rng, i) for i in range(N)]
                for i in range(N - 1):
                    x_BxTxD, _ = block(graphdef, jax.tree.map(lambda a: a[i], params["dense"]), x_BxTxD, keys[i])
                x_BxTxD, aux = block(moe_def, params["moe"], x_BxTxD, keys[-1])
            return (x_BxTxD, aux) if with_aux else x_BxTxD

        return _remat(layer, self.cfg.remat)

    def layer_params(self):
        """The stacked weights ``layer_fn`` takes, leading dim = its layers: the blocks', or
        with MoE layers every ``moe_every``-th layer ``{"dense": (L/N, N-1, ...), "moe":
        (L/N, ...)}``."""
        params = nnx.state(self.blocks)
        if not hasattr(self, "moe_blocks"):
            return params
        G, N = self.cfg.layers // self.cfg.moe_every, self.cfg.moe_every
        dense = jax.tree.map(lambda a: a.reshape((G, N - 1) + a.shape[1:]), params)
        return {"dense": dense, "moe": nnx.state(self.moe_blocks)}

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        # Gather from a table whose embed dim is whole (FSDP gathers it, as for any weight
        # it uses); with embed still sharded, XLA's partitioner falls back to replicating
        # the gather's output.
        table_VxD = constrain(self.embed[...], ("vocab", None))
        x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0)
        return constrain(x_BxTxD, ("batch", "seq", None))

    def head_params(self) -> dict:
        """What the output head reads: the final norm's scale and the (V, D) output matrix
        (the embedding when tied); passed as ``loss_params`` to a 1F1B pipeline."""
        out_VxD = self.embed[...] if self.cfg.tie_embeddings else self.head[...].T
        return {"norm": self.final_norm.scale[...], "out": out_VxD}

    def logits(self, x_BxTxD: jax.Array) -> jax.Array:
        return head_logits(self.head_params(), x_BxTxD, self.cfg.norm_eps)

    def __call__(self, tokens_BxT: jax.Array, *, pipeline: PipelineSpec | None = None,
                 rng: jax.Array | None = None):
        return self.logits(self.hidden(tokens_BxT, pipeline=pipeline, rng=rng))

    def hidden(self, tokens_BxT: jax.Array, *, pipeline: PipelineSpec | None = None,
               loss_fn=None, loss_params=None, targets=None, rng: jax.Array | None = None,
               with_aux: bool = False) -> jax.Array:
        """Embeds and runs the layer stack: ``lax.scan`` over layers, or ``sk.pipeline`` over
        the ``pipe`` axis (with ``loss_fn``, the pipeline's mean loss instead). ``rng``
        (training) turns on dropout when ``Config.dropout > 0``: layer ``l`` draws its masks
        from ``fold_in(rng, l)`` (in a pipeline, folded with the microbatch too).
        ``with_aux`` (no pipeline): ``(x, router stats per MoE layer or None)``."""
        T = tokens_BxT.shape[1]
        if T > self.cfg.seq:
            raise ValueError(f"sequence length {T} exceeds Config.seq={self.cfg.seq}")
        rng = rng if self.cfg.dropout > 0 else None
        x_BxTxD = self.embed_tokens(tokens_BxT)
        params = self.layer_params()
        if pipeline is None:
            layer = self.layer_fn(T, with_aux=True)

            def body(x, p_l):
                p, l = p_l
                return layer(p, x, None if rng is None else jax.random.fold_in(rng, l))

            n = jax.tree.leaves(params)[0].shape[0]
            x_BxTxD, aux = jax.lax.scan(body, x_BxTxD, (params, jnp.arange(n)),
                                        unroll=self.cfg.scan_unroll)
            return (x_BxTxD, aux) if with_aux else x_BxTxD
        layer = self.layer_fn(T)
        dtype = x_BxTxD.dtype
        stage = layer if rng is None else (lambda p, x, *, rng: layer(p, x, rng))
        if dtype != F32 and sk.target_platform() == "cpu":
            # Workaround, XLA:CPU only: it aborts ("Invalid binary instruction opcode copy")
            # compiling the gradient of a bf16 pipeline input when the batch is also split over
            # a data axis. There the pipeline carries f32 activations (each layer still
            # computes in bf16); GPUs and TPUs carry the compute dtype, half the permute bytes.
            inner = stage
            stage = lambda p, x, **kw: inner(p, x.astype(dtype), **kw).astype(F32)  # noqa: E731
            x_BxTxD = x_BxTxD.astype(F32)
        y = sk.pipeline(stage, params, x_BxTxD, microbatches=pipeline.microbatches,
                        schedule=pipeline.schedule, repeats=pipeline.repeats, layer_order=pipeline.layer_order,
                        keep=pipeline.keep, loss_fn=loss_fn, loss_params=loss_params, targets=targets, rng=rng)
        return y if loss_fn is not None else y.astype(dtype)


def head_logits(head: dict, x_BxTxD: jax.Array, eps: float) -> jax.Array:
    """Final RMSNorm, then logits (float32) against the (V, D) output matrix."""
    x_BxTxD = rms_norm(x_BxTxD, head["norm"], eps)
    logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, head["out"], preferred_element_type=F32)
    return constrain(logits_BxTxV, ("batch", "context", "vocab"))


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    # sk.kernels.cross_entropy picks the target's logit without a gather: XLA's partitioner
    # aborts on that gather inside a pipeline stage whose logits are split over two
    # compiler-owned axes (context or expert, and tensor).
    return sk.kernels.cross_entropy(logits_BxTxV, targets_BxT).mean()


def loss_chunk(cfg: Config, T: int) -> int:
    """Positions per chunk of the chunked loss for sequences of T tokens, or 0 for the plain
    one (``Config.loss_chunk``; -1: chunks of 512 where one sequence's f32 logits pass 64 MiB
    on a GPU/TPU target, where the memory is what decides what fits)."""
    if cfg.loss_chunk >= 0:
        return cfg.loss_chunk
    big = T * cfg.vocab * 4 > 64 * 2**20
    return 512 if big and T > 512 and sk.target_platform() != "cpu" else 0


def head_loss(head: dict, x_BxTxD: jax.Array, targets_BxT: jax.Array, cfg: Config) -> jax.Array:
    """Mean cross-entropy of the head (final norm, output matrix) on the last hidden states:
    plain (whole f32 logits), or ``sk.chunked_cross_entropy`` (never the whole logits) as
    ``loss_chunk`` says."""
    chunk = loss_chunk(cfg, x_BxTxD.shape[1])
    if not chunk:
        return cross_entropy(head_logits(head, x_BxTxD, cfg.norm_eps), targets_BxT)
    x_BxTxD = rms_norm(x_BxTxD, head["norm"], cfg.norm_eps)
    return sk.chunked_cross_entropy(x_BxTxD, head["out"], targets_BxT, chunk=chunk)


def loss_fn(model: Transformer, batch: dict, pipeline: PipelineSpec | None = None,
            rng: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross entropy; ``batch = {"inputs": (B,T), "targets": (B,T)}``;
    ``rng`` (training) turns on ``Config.dropout``.

    Under the explicit-backward schedules (1F1B, interleaved 1F1B, ZB-H1) the loss is computed
    inside the pipeline, so the head goes in as ``loss_params``. Under context parallelism the batch
    is reordered for causal load balancing first (``sk.context_shard``).
    """
    if model.cfg.moe_experts and pipeline is None:
        return moe_loss_fn(model, batch, rng=rng)[0]
    batch = _context_order(batch)
    if pipeline is not None and pipeline.schedule not in AUTODIFF_SCHEDULES:
        cfg = model.cfg
        return model.hidden(
            batch["inputs"], pipeline=pipeline, loss_params=model.head_params(),
            loss_fn=lambda head, y, t: head_loss(head, y, t, cfg),
            targets=batch["targets"], rng=rng)
    x_BxTxD = model.hidden(batch["inputs"], pipeline=pipeline, rng=rng)
    return head_loss(model.head_params(), x_BxTxD, batch["targets"], model.cfg)


def _context_order(batch: dict) -> dict:
    """Under context parallelism, inputs and targets in ``sk.context_shard``'s zig-zag order
    (the causal work is then even over the axis; the mean loss is unchanged); else as given."""
    return sk.context_shard(batch) if context_size() > 1 else batch


def moe_loss_fn(model: Transformer, batch: dict, pipeline: PipelineSpec | None = None,
                rng: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """``(objective, metrics)`` of an MoE model: cross entropy + ``moe_aux_weight`` x the
    load-balancing loss + ``moe_z_weight`` x the z-loss (each averaged over MoE layers);
    metrics: ``ce`` and the layers' mean ``moe/load_balance``, ``moe/z_loss``,
    ``moe/dropped_fraction``, ``moe/tokens_per_expert``. Under a pipeline the stages return
    activations only (``sk.pipeline``): the objective is the cross entropy alone."""
    if pipeline is not None:
        ce = loss_fn(model, batch, pipeline, rng)
        return ce, {"ce": ce}
    batch = _context_order(batch)
    x_BxTxD, aux = model.hidden(batch["inputs"], rng=rng, with_aux=True)
    ce = head_loss(model.head_params(), x_BxTxD, batch["targets"], model.cfg)
    mean = jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)
    cfg = model.cfg
    objective = ce + cfg.moe_aux_weight * mean["load_balance"] + cfg.moe_z_weight * mean["z_loss"]
    return objective, {"ce": ce, **{f"moe/{k}": v for k, v in mean.items()}}


def param_count(cfg: Config, *, embedding: bool = True) -> int:
    """Parameters, from the shapes alone (``embedding=False`` leaves out the input table,
    but keeps an untied head)."""
    D, H, K, Q, F, V, L = (cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff,
                           cfg.vocab, cfg.layers)
    per_layer = D * H * Q * 2 + D * K * Q * 2 + 3 * D * F + 2 * D
    head = 0 if cfg.tie_embeddings else D * V
    n_moe = cfg.layers // cfg.moe_every if cfg.moe_experts else 0
    experts = n_moe * ((cfg.moe_experts - 1) * 3 * D * F + D * cfg.moe_experts)  # + router
    return L * per_layer + D + head + (V * D if embedding else 0) + experts


def flops_per_token(cfg: Config, seq: int | None = None) -> float:
    """Training flops per token: 6·N + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, app. B).

    N counts every weight that takes part in a matmul: the layers and the output projection
    (the tied embedding counts once, as the head; the input lookup is a gather, not a
    matmul). The attention term is the full T×T score/value product, forward and backward,
    because this model computes the masked half too. An MoE layer counts its active weights
    only: the router and ``moe_top_k`` experts (MFU counts useful flops; a dropless layer's
    padded buffers compute more).
    """
    T = cfg.seq if seq is None else seq
    D, H, K, Q, F = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
    n_matmul = cfg.layers * (2 * D * H * Q + 2 * D * K * Q + 3 * D * F) + D * cfg.vocab
    if cfg.moe_experts:
        n_matmul += cfg.layers // cfg.moe_every * ((cfg.moe_top_k - 1) * 3 * D * F + D * cfg.moe_experts)
    return 6.0 * n_matmul + 12.0 * cfg.layers * cfg.heads * cfg.head_dim * T


@functools.lru_cache(maxsize=None)
def abstract_model(cfg: Config) -> Transformer:
    """The model with ShapeDtypeStruct leaves (no arrays allocated), for specs and snapshots."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
