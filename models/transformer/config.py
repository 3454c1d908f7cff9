"""Model shapes for the transformer recipe: one frozen dataclass and a few named sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload", "lean")
ATTENTION = ("auto", "reference", "xla", "cudnn", "triton", "mosaic", "blockwise")


@dataclass(frozen=True)
class Config:
    """Shapes of a GPT-style pre-norm decoder (RMSNorm, rotary, GQA, SwiGLU).

    Attributes:
        vocab: vocabulary size (256 for the byte-level corpus).
        d_model: width of the residual stream.
        layers: number of decoder blocks; they are stacked and scanned.
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention); ``None`` means ``heads``.
        head_dim: per-head width; ``None`` means ``d_model // heads``.
        d_ff: SwiGLU hidden width; ``None`` means 8/3·d_model rounded up to a multiple of 32.
        seq: context length the model is sized for (rotary tables, flop counts).
        tie_embeddings: reuse the input embedding as the output projection.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        init_std: std of the normal initialiser; residual output projections use
            ``init_std / sqrt(2·layers)`` (GPT-2).
        remat: activation checkpointing per layer: ``"none"``, ``"full"`` (recompute
            everything), ``"dots"`` (save matmul outputs) or ``"dots_no_batch"`` (save only
            matmuls without batch dims, i.e. weight-stationary ones) or ``"offload"`` (as
            ``"dots_no_batch"``, saved in pinned host memory: ``sk.offload.remat_policy``) or
            ``"lean"`` (the values named ``sk.LEAN_RESIDUALS``: the matmul outputs and the
            mid-layer residual stream; norms, SwiGLU and SP gathers recomputed).
        fp8: the attention projections and MLP matmuls in fp8 (``sk.fp8.Fp8Dot``: E4M3
            forward, E5M2 gradients, delayed scaling; the recipe's ``--precision fp8``);
            attention scores, MoE experts and the output head stay in the compute dtype.
        scan_unroll: layers per iteration of the layer scan (``lax.scan(unroll=...)``);
            1 keeps compile time flat in depth, ``layers`` unrolls fully (XLA's
            ``cost_analysis`` counts a loop body once, so exact flop counts need it).
        dropout: residual dropout rate on each attention and MLP output (GPT-2), applied
            when the loss is given an ``rng`` (training); 0 disables it.
        moe_experts: experts per mixture-of-experts layer (``sk.moe``); 0: dense MLPs only.
        moe_top_k: experts each token visits.
        moe_every: every ``moe_every``-th layer is an MoE layer (1: all of them); the layers
            are run in groups of ``moe_every`` (``moe_every - 1`` dense, then one MoE).
        moe_capacity: capacity factor (each expert takes ``ceil(c·k·T/E)`` tokens of a
            sequence; the rest pass through the residual); ``None``: dropless.
        moe_aux_weight: weight of the router's load-balancing loss (Switch Transformer),
            averaged over MoE layers, in the training objective.
        moe_z_weight: weight of the router z-loss (ST-MoE), averaged over MoE layers.
        attention: ``"reference"`` (jnp softmax, f32 scores), ``"xla"``
            (``jax.nn.dot_product_attention``'s), one of ``sk.attention``'s flash kernels
            (``"cudnn"``: a GPU and a 16-bit dtype; ``"triton"``, ``"mosaic"``: Pallas on
            GPU / TPU; ``"blockwise"``: the online-softmax scan anywhere), or ``"auto"``: the
            target's kernel on GPU and TPU (cuDNN on a GPU in 16-bit, Triton in deviceless GPU
            compiles, Mosaic on TPU; ``attention.attention_impl``), the reference on CPU.
        loss_chunk: the output projection + cross-entropy in chunks of this many positions
            per sequence (``sk.chunked_cross_entropy``: the (tokens, vocab) f32 logits and
            their gradient are never whole); 0: the plain loss; -1 (default): chunks of 512
            on GPU/TPU targets where one sequence's f32 logits pass 64 MiB, else plain.
        context_strategy: how attention runs on a ``context`` mesh axis
            (``sk.context_attention``): ``"ring"`` (K/V blocks passed around the axis,
            overlapping the next block's compute) or ``"allgather"`` (K/V gathered whole once).
    """

    vocab: int = 256
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    seq: int = 64
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    remat: str = "none"
    scan_unroll: int = 1
    dropout: float = 0.0
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity: float | None = None
    moe_aux_weight: float = 0.01
    moe_z_weight: float = 0.001
    attention: str = "auto"
    context_strategy: str = "ring"
    fp8: bool = False
    loss_chunk: int = -1

    def __post_init__(self):
        for name in ("vocab", "d_model", "layers", "heads", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{name} must be a positive integer, got {value!r}")
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None:
            if self.d_model % self.heads:
                raise ValueError(
                    f"Config.d_model={self.d_model} is not divisible by heads={self.heads}; "
                    "pick heads that divide d_model, or set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", -(-8 * self.d_model // 3 // 32) * 32)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"Config.heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                "grouped-query attention shares each kv head among heads/kv_heads query heads")
        if self.head_dim % 2:
            raise ValueError(f"Config.head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Config.dropout={self.dropout!r} must be in [0, 1)")
        if self.attention not in ATTENTION:
            raise ValueError(f"Config.attention={self.attention!r} is not one of {ATTENTION}")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < -1:
            raise ValueError(f"Config.loss_chunk={self.loss_chunk!r} must be -1 (auto), 0 (plain) or a "
                             "positive number of positions per chunk")
        if self.context_strategy not in ("ring", "allgather"):
            raise ValueError(f"Config.context_strategy={self.context_strategy!r} is not one of ('ring', 'allgather')")
        if self.moe_experts:
            if not isinstance(self.moe_experts, int) or self.moe_experts < 1:
                raise ValueError(f"Config.moe_experts={self.moe_experts!r} must be a positive integer (0: dense)")
            if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= self.moe_experts:
                raise ValueError(f"Config.moe_top_k={self.moe_top_k!r} must be in 1..moe_experts={self.moe_experts}")
            if not isinstance(self.moe_every, int) or self.moe_every < 1 or self.layers % self.moe_every:
                raise ValueError(f"Config.moe_every={self.moe_every!r} must be a positive divisor of "
                                 f"layers={self.layers}")
            if self.moe_capacity is not None and not self.moe_capacity > 0:
                raise ValueError(f"Config.moe_capacity={self.moe_capacity!r} must be positive, or None (dropless)")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"Config.remat={self.remat!r} is not one of {REMAT_POLICIES}")

    def replace(self, **changes) -> "Config":
        """A copy with ``changes``; derived sizes (head_dim, d_ff, kv_heads) are recomputed
        unless given."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        derived = {"kv_heads": "heads", "head_dim": ("d_model", "heads"), "d_ff": "d_model"}
        for field, sources in derived.items():
            sources = (sources,) if isinstance(sources, str) else sources
            if field not in changes and any(s in changes for s in sources):
                base[field] = None
        base.update(changes)
        return Config(**base)

    @property
    def groups(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads


# Named sizes. "tiny" trains in seconds on simulated CPU devices; the others are for
# `explain` / golden snapshots (GPT-3 small, a Llama-3.2-1B-like and a Llama-2-7B-like shape).
SIZES: dict[str, Config] = {
    "test": Config(vocab=256, d_model=32, layers=2, heads=4, kv_heads=2, seq=16),
    "tiny": Config(vocab=256, d_model=128, layers=4, heads=4, seq=128),
    "125m": Config(vocab=50304, d_model=768, layers=12, heads=12, d_ff=2048, seq=1024),
    "1b": Config(vocab=50304, d_model=2048, layers=16, heads=32, kv_heads=8, d_ff=8192, seq=2048),
    "7b": Config(vocab=32000, d_model=4096, layers=32, heads=32, d_ff=11008, seq=4096,
                 tie_embeddings=False),
    # Long context at small width: 8192 tokens, for context parallelism on 8 simulated devices
    # (--mesh context=8: 1024 tokens per device; attention, not weights, decides what fits).
    "long": Config(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, seq=8192),
}
