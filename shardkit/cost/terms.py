"""What the cost model talks about: a model's shape (``ModelShape``), a layout (``Layout``), the
collective roles (``ROLES``) and the traffic a formula counts in them (``RoleTraffic``), and the
estimate of one step on it (``Estimate``), plus a few named decoder shapes for the ``shardkit
plan`` command.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from . import hardware as hw_lib

# Named decoder-only transformer shapes for ``shardkit plan --model NAME`` and ``sk.search("7b", ...)``
# (GPT/LLaMA-style: RMS-norm, SwiGLU MLP with 3 matrices, grouped-query attention). "7b" is
# LLaMA-7B (Touvron et al. 2023). Any other model: pass a ``ModelShape``, a config object with
# these fields, or a parameter pytree.
DECODER_SIZES: dict[str, dict] = {
    "125m": dict(vocab=50304, d_model=768, layers=12, heads=12, kv_heads=12, d_ff=2048, seq=1024, tie=True),
    "1b": dict(vocab=50304, d_model=2048, layers=16, heads=32, kv_heads=8, d_ff=8192, seq=2048, tie=True),
    "7b": dict(vocab=32000, d_model=4096, layers=32, heads=32, kv_heads=32, d_ff=11008, seq=4096, tie=False),
}
# Every collective role, in the order an estimate lists them: the one list; the others below
# are derived from it.
ROLES = ("grad-reduce", "param-gather", "tensor-reduce", "tensor-gather", "pipe-permute", "pipe-reduce",
         "pipe-relayout", "expert-all-to-all", "replica-reduce", "context-permute", "context-gather",
         "context-reduce")
# What one step runs, which ``steptime`` times: all but DiLoCo's outer sync (``replica-reduce``
# runs as its own program every ``diloco_every`` steps, timed apart).
STEP_ROLES = tuple(r for r in ROLES if r != "replica-reduce")
# What ``sk.Report.roles()`` reads off a compiled program by the mesh axes a collective spans: a
# step's roles but ``context-reduce`` (a reduction over ``context`` is the weights' gradients
# reduced there, read as ``grad-reduce``), and ``other`` for what no role explains.
COMPILED_ROLES = tuple(r for r in STEP_ROLES if r != "context-reduce") + ("other",)


@dataclasses.dataclass(frozen=True)
class RoleTraffic:
    """Collectives per device per step by role (``ROLES``' names), as one formula hands them
    back (``roles.tensor_traffic``, ``roles.data_traffic``, ``pipeline_cost.pipeline_traffic``);
    an estimator adds its parts up once (``a + b``: role by role).

    Attributes:
        bytes: bytes per role (reductions the bytes reduced, gathers the gathered result).
        ops: collectives per role.
    """

    bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    ops: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def zero(cls) -> "RoleTraffic":
        """Every role, at nothing: where an estimator's sum starts."""
        return cls(dict.fromkeys(ROLES, 0.0), dict.fromkeys(ROLES, 0.0))

    def __add__(self, other: "RoleTraffic") -> "RoleTraffic":
        nbytes, ops = dict(self.bytes), dict(self.ops)
        for role, x in other.bytes.items():
            nbytes[role] = nbytes.get(role, 0.0) + x
        for role, x in other.ops.items():
            ops[role] = ops.get(role, 0.0) + x
        return RoleTraffic(nbytes, ops)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model as the cost model sees it: everything the formulas need, nothing about where the
    numbers came from.

    Attributes:
        name: label for tables.
        params: parameter count Ψ.
        flops_per_token: training flops per token (forward + backward), e.g. 6 × matmul
            parameters + attention.
        layers: repeated blocks (what a pipeline splits); 1 for a plain pytree.
        layer_params: parameters inside the repeated blocks (the rest: embeddings, head, norms).
        d_model, heads, d_ff, vocab: widths for tensor-parallel traffic and activation memory
            (0 when unknown: no TP traffic, activations from ``act_bytes_per_token``).
        seq: tokens per example.
        act_bytes_per_token: saved activation bytes per token per layer, overriding
            Korthikanti's formula (for non-transformer models).
        embedding_params: parameters of tables looked up by index (no matmul flops: a lookup
            gathers rows). A tied table is also the head (it is then a matmul too).
        head: the model ends in a vocabulary projection (logits of width ``vocab``).
        tie: the embedding doubles as the output head (its gradient has two parts, which
            ``sk.pipeline`` reduces apart: the head's inside, the lookup's outside).
        gated, flash_attention, dropout: what the transformer's memory-bound kernels read
            and write (``steptime.memory_bound_time``): a gated (SwiGLU) MLP, attention
            scores kept on chip, dropout masks.
        kv_heads: key/value heads (grouped-query attention; 0 = ``heads``), for the K/V
            blocks context parallelism moves.
        experts, top_k, moe_every, capacity_factor: mixture-of-experts layers (``sk.moe``):
            ``experts`` per MoE layer (0: dense), each token visits ``top_k``, every
            ``moe_every``-th layer is one, capacity factor (``None``: dropless).
        expert_params: parameters inside the experts (all layers); split over the ``expert``
            axis, and not reduced over it (``flops_per_token`` counts active experts only).
        loss_chunk: the loss runs in chunks of this many positions per sequence
            (``sk.chunked_cross_entropy``): one chunk's logits and the f32 (vocab, d_model)
            gradient accumulator are alive, never the whole (tokens, vocab) f32 logits; 0: the
            plain loss. A recipe ``Config``'s ``loss_chunk=-1`` (auto) resolves as the recipe
            does on a GPU/TPU target (``models.transformer.model.loss_chunk``).
        activations: how a layer's saved activations are counted (``roles.activation_bytes``):
            ``"korthikanti"``, Korthikanti et al.'s Table 2 for Megatron's GPT layer (GELU MLP
            of 4h, one K/V head per head, dropout, scores saved); or ``"xla"``, the tensors
            XLA's autodiff keeps for this model's widths (gated MLP, grouped K/V heads,
            ``flash_attention``, ``dropout``; under sequence parallelism the gathered inputs of
            the column-parallel matmuls kept whole), without recompute and under remat
            "dots" (``remat`` "full" keeps Korthikanti's form). A ``ModelShape`` read from a
            recipe config or a ``DECODER_SIZES`` name (a pre-norm RMSNorm/SwiGLU decoder) counts
            ``"xla"``: its layer is the one that form was counted from.
    """

    name: str
    params: float
    flops_per_token: float
    layers: int = 1
    layer_params: float = 0.0
    d_model: int = 0
    heads: int = 0
    d_ff: int = 0
    vocab: int = 0
    seq: int = 1
    act_bytes_per_token: float | None = None
    embedding_params: float = 0.0
    head: bool = False
    tie: bool = False
    gated: bool = True
    flash_attention: bool = True
    dropout: bool = False
    kv_heads: int = 0
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1
    capacity_factor: float | None = None
    expert_params: float = 0.0
    activations: str = "korthikanti"
    loss_chunk: int = 0

    @property
    def matmul_params(self) -> float:
        """Parameters used as matmul weights (a tied table counts: it is the head)."""
        return self.params - (0.0 if self.tie else self.embedding_params)


def model_shape(model: Any, *, flops_per_token: float | None = None, seq: int | None = None) -> ModelShape:
    """A ``ModelShape`` from a name in ``DECODER_SIZES``, a transformer config (anything with
    ``d_model``/``layers``/``heads``/``d_ff``/``vocab``, as a mapping or attributes), a
    ``ModelShape``, or a parameter pytree (then give ``flops_per_token``: a pytree says nothing
    about how its leaves are used; without it 6 × parameters is assumed, Kaplan et al. 2020).

    Raises:
        ValueError: an unknown size name.
    """
    if isinstance(model, ModelShape):
        if seq in (None, model.seq) and flops_per_token is None:
            return model  # frozen: the search's thousands of estimates share it
        ms = dataclasses.replace(model, seq=seq or model.seq)
        return dataclasses.replace(ms, flops_per_token=flops_per_token) if flops_per_token else ms
    if isinstance(model, str):
        if model not in DECODER_SIZES:
            raise ValueError(f"unknown model size {model!r}; known: {', '.join(DECODER_SIZES)}, or pass a "
                             "config, a ModelShape, or a parameter pytree with flops_per_token=")
        ms = _from_config(DECODER_SIZES[model], model, seq)
        return dataclasses.replace(ms, flops_per_token=flops_per_token) if flops_per_token else ms
    is_config = (isinstance(model, Mapping) and "d_model" in model and "layers" in model) or (
        hasattr(model, "d_model") and hasattr(model, "layers"))
    if is_config:
        name = model.get("name", "config") if isinstance(model, Mapping) else getattr(model, "name", "config")
        ms = _from_config(model, name, seq)
        return dataclasses.replace(ms, flops_per_token=flops_per_token) if flops_per_token else ms
    import jax

    n = float(sum(math.prod(getattr(x, "shape", ())) for x in jax.tree.leaves(model)))
    return ModelShape("pytree", n, flops_per_token or 6.0 * n, seq=seq or 1)


def _from_config(cfg, name: str, seq: int | None) -> ModelShape:
    get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
    D, L, H, F, V = get("d_model"), get("layers"), get("heads"), get("d_ff"), get("vocab")
    K = get("kv_heads") or H
    Q = get("head_dim") or D // H
    tie = get("tie", get("tie_embeddings", True))
    T = seq or get("seq")
    kernels = _kernels(get("attention", "auto"), get("loss_chunk", 0) or 0, T, V)
    per_layer = 2 * D * H * Q + 2 * D * K * Q + 3 * D * F + 2 * D
    rest = V * D * (1 if tie else 2) + D
    # Training flops per token: 6 x matmul weights + attention 12·L·H·Q·T (PaLM, app. B).
    n_matmul = L * (2 * D * H * Q + 2 * D * K * Q + 3 * D * F) + D * V
    fpt = 6.0 * n_matmul + 12.0 * L * H * Q * T
    E, k, every = get("moe_experts", 0) or 0, get("moe_top_k", 1) or 1, get("moe_every", 1) or 1
    if E:  # E experts' SwiGLU weights and a router per MoE layer; flops count k experts
        n_moe = L // every
        extra = n_moe * ((E - 1) * 3 * D * F + D * E)
        per_layer_total = L * per_layer + extra
        fpt += 6.0 * n_moe * ((k - 1) * 3 * D * F + D * E)
        moe = dict(experts=E, top_k=k, moe_every=every, capacity_factor=get("moe_capacity"),
                   expert_params=float(n_moe * E * 3 * D * F))
        return ModelShape(name, float(per_layer_total + rest), fpt, L, float(per_layer_total), D, H, F, V,
                          T, embedding_params=float(V * D), head=True, tie=bool(tie), kv_heads=K, activations="xla",
                          **moe, **kernels)
    return ModelShape(name, float(L * per_layer + rest), fpt, L, float(L * per_layer), D, H, F, V, T,
                      embedding_params=float(V * D), head=True, tie=bool(tie), kv_heads=K, activations="xla",
                      **kernels)


def _kernels(attention: str, loss_chunk: int, T: int, V: int) -> dict:
    """The kernels a recipe ``Config`` runs on the GPU/TPU targets the hardware table holds:
    ``attention`` "reference" and "xla" keep the (T, T) scores, every other choice runs
    ``sk.attention`` (a flash kernel, or its blockwise fallback: neither writes them);
    ``loss_chunk`` -1 (auto) is the recipe's rule on those targets: chunks of 512 where one
    sequence's f32 logits pass 64 MiB."""
    if loss_chunk < 0:
        loss_chunk = 512 if T * V * 4 > 64 * 2**20 and T > 512 else 0
    return dict(flash_attention=attention not in ("reference", "xla"), loss_chunk=loss_chunk)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a step: mesh axis sizes (outermost first: pipe, data, fsdp, tensor),
    ZeRO stage over the data axes, microbatches, pipeline schedule and remat policy.

    Attributes:
        data, fsdp, tensor, pipe: axis sizes. ``fsdp`` always shards weights (ZeRO-3 over it);
            ``zero`` adds the ``data`` axis to ZeRO's sharding.
        zero: 0, 1, 2 or 3.
        microbatches: gradient-accumulation steps, or pipeline microbatches.
        schedule: one of ``sk.pipeline``'s schedules (``"gpipe"``, ``"circular"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zb-h1"``; with ``pipe > 1``).
        repeats: layer chunks per stage for ``"circular"``.
        remat: ``"none"``, ``"dots"`` (selective) or ``"full"``.
        sequence_parallel: shard the residual stream over ``tensor`` between TP regions.
        context: context-parallel axis size (``sk.context_attention``): the sequence is split
            over it, so activations shrink as T/context and each attention layer moves K/V
            around it (``from_shape.context_traffic``); between fsdp and tensor in the mesh.
        expert: expert-parallel axis size (``sk.moe``): expert weights are split over it and
            the batch too (a data axis for every other weight); each MoE layer moves its
            tokens to their experts and back (``from_shape.moe_traffic``); between fsdp and
            context in the mesh.
        replica, diloco_every: DiLoCo (``sk.DiLoCo``): ``replica`` copies of the layout
            above, outermost in the mesh (across the slow link), each training on 1/replica of
            the batch and syncing over ``replica`` once every ``diloco_every`` steps: one f32
            all-reduce of its shard of the parameters (the outer update's layout), amortised
            over the interval and fully exposed (``diloco_cost.diloco_terms``).
        keep_residuals: ``"1f1b"`` / ``"interleaved-1f1b"`` run as Megatron-LM and PyTorch's
            pipelining run them, not as ``sk.pipeline`` does: every in-flight microbatch keeps
            its residuals and the backward does not recompute the forward (no recompute flops,
            no stage-input rings), ZeRO-3/FSDP weights are gathered once per step and kept (no
            resharding after the forward), and the stage's gradients accumulate in one f32
            buffer (``from_shape._memory``). ``sk.pipeline`` keeps the residuals with ``keep="all"``; its
            weights and gradient buffers are still as the other explicit layouts'.
        keep: what an explicit schedule's forward keeps for its chunk-microbatch's backward
            op (``sk.pipeline(keep=)``, with ``remat="none"``): ``"input"`` (the stage input;
            the op recomputes the chunk's forward), ``"all"`` (every residual, no recompute)
            or ``"dots"`` (the remat policy's saved set, in a ring of in-flight slots).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    remat: str = "none"
    sequence_parallel: bool = False
    context: int = 1
    expert: int = 1

    replica: int = 1
    diloco_every: int = 1
    keep_residuals: bool = False
    keep: str = "input"

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipe * self.context * self.expert * self.replica

    @property
    def mesh(self) -> str:
        """The ``sk.make_mesh`` spec (axes of size 1 left out)."""
        axes = [(n, getattr(self, n)) for n in ("replica", "pipe", "data", "fsdp", "expert", "context", "tensor")]
        return ",".join(f"{n}={s}" for n, s in axes if s > 1) or "data=1"

    def axis_stride(self, axis: str) -> int:
        """Devices between neighbours along ``axis`` (inner axes are the fast ones)."""
        order = ("replica", "pipe", "data", "fsdp", "expert", "context", "tensor")
        return math.prod(getattr(self, a) for a in order[order.index(axis) + 1:])

    def __str__(self) -> str:
        extra = f",{self.schedule}" + (f"x{self.repeats}" if self.repeats > 1 else "") if self.pipe > 1 else ""
        sp = ",sp" if self.sequence_parallel else ""
        diloco = f",diloco={self.diloco_every}" if self.replica > 1 else ""
        keep = ",keep-residuals" if self.keep_residuals and self.pipe > 1 else ""
        keep += f",keep={self.keep}" if self.keep != "input" and self.pipe > 1 else ""
        return f"{self.mesh} zero={self.zero} m={self.microbatches} remat={self.remat}{extra}{keep}{sp}{diloco}"


@dataclasses.dataclass
class Estimate:
    """Estimated per-device cost of one training step.

    Attributes:
        memory: bytes by kind: ``params``, ``opt_state``, ``grads``, ``activations``,
            ``batch``, ``arguments``, ``temporaries``, ``peak``.
        collectives: bytes by role (``grad-reduce``, ``param-gather``, ``tensor-reduce``,
            ``tensor-gather``, ``pipe-permute``), counted as ``sk.Report`` counts them.
        flops: executed flops (with recomputation, and a GPipe/circular pipeline's idle ticks,
            which compute too); ``model_flops``: the useful ones.
        time: seconds by part: ``compute`` (at the hardware's achievable matmul efficiency),
            one entry per collective role (its full time), ``bubble``, ``exposed`` (the
            communication left on the critical path) and ``step`` = compute + bubble + exposed
            (``steptime.times``).
        hardware: the accelerator name; ``layout``: what was estimated; ``tokens``: per step.
        memory_limit: bytes available per device.
        notes: how the figures were modelled and what they cannot see, for the reader.
        caveats: quantity (``as_dict``'s names) -> why its figure is only a bound or an
            approximation (what XLA decides that the model cannot see); a quantity absent here
            is modelled.
    """

    memory: dict[str, float]
    collectives: dict[str, float]
    flops: float
    model_flops: float
    time: dict[str, float]
    hardware: str
    layout: Any = None
    tokens: float = 0.0
    memory_limit: float = float("inf")
    devices: int = 1
    notes: list[str] = dataclasses.field(default_factory=list)
    caveats: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def step_time(self) -> float:
        return self.time["step"]

    @property
    def mfu(self) -> float:
        """Model flops utilisation: useful flops / (step time × peak) (PaLM's definition)."""
        peak = hw_lib.lookup(self.hardware).peak_flops
        return self.model_flops / (self.step_time * peak) if self.step_time else 0.0

    @property
    def fits(self) -> bool:
        return self.memory["peak"] <= self.memory_limit

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time else 0.0

    def as_dict(self) -> dict[str, float]:
        """Quantities under ``Report.comparison``'s names (``memory/peak``, ``collective/
        grad-reduce``, ``flops``) plus ``time/...``."""
        out = {f"memory/{k}": float(v) for k, v in self.memory.items()}
        out.update({f"collective/{k}": float(v) for k, v in self.collectives.items()})
        out["flops"] = float(self.flops)
        out.update({f"time/{k}": float(v) for k, v in self.time.items()})
        return out


def tokens_in(batch) -> int:
    """Tokens in a batch: integer leaves are token ids (every element a token), float leaves
    carry features in their last dimension."""
    import jax
    import numpy as np

    best = 1
    for x in jax.tree.leaves(batch):
        shape = tuple(getattr(x, "shape", ()))
        if not shape:
            continue
        if np.issubdtype(np.dtype(x.dtype), np.integer):
            best = max(best, math.prod(shape))
        else:
            best = max(best, math.prod(shape[:-1]) if len(shape) > 1 else shape[0])
    return best



