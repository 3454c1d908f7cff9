"""What the program reader (``program.read_program``) returns: one microbatch's forward +
backward pass as one device runs it — parameter uses, matmul flops, live bytes, the
tensor-parallel collectives its contractions leave, and what it could not see."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ProgramReading:
    """What one microbatch's forward + backward pass does, per device.

    Attributes:
        lookup: per parameter leaf, whether it is indexed (``gather``: an embedding table).
        matmul: per parameter leaf, whether it is a matmul/convolution operand.
        conv: per parameter leaf, how many convolutions read it (0: not a kernel); the
            backward's input-gradient convolution reads the kernel reversed (``rev``).
        loop_use: per parameter leaf, whether a loop body (``scan``/``while``) uses it: XLA
            then gathers a ZeRO-3 weight inside the loop, forward and backward (else once).
        flops: matmul + convolution flops one device executes for one microbatch (each op's
            global flops over the largest split of its operands and result).
        total_flops: the same on all devices together (each op counted once).
        peak: the largest sum of live materialised buffers during the pass (bytes, one device),
            arguments (parameters, batch) excluded; the gradients are live at its end.
        residuals: bytes live when the backward pass starts (what the forward keeps for it).
        tensor_reduce: elements one device all-reduces over the tensor-like axes (the results
            of matmuls that contract a tensor-split dimension); ``tensor_reduce_ops``: how many.
        explicit: ``{(collective kind, mesh axes): [executions, result bytes]}`` per device of
            the collectives the program writes itself (inside ``shard_map``), through loops.
        shard_maps: how many ``shard_map`` regions the program has (manual partitioning);
            ``weight_shard_maps``: how many of them take a parameter (not an attention kernel's,
            which takes activations only).
        notes: what the reader could not see into.
        row_syncs: (all-reduces over the data axes the pass waits for apart from the
            gradients' reduction, their bytes): ``row_syncs.row_syncs``. ``split_followed``: the
            weights' tensor-split dims placed the reductions inside every ``shard_map`` too.
        moved: per parameter leaf, whether a matmul reading it moves fewer elements than the
            weight holds, where XLA may gather activations instead of it (``gather_or_move``).
        unseen: what the program holds that the model cannot see, ``{kind: description}``:
            ``"kernel"`` (a custom call or Pallas kernel: opaque flops and buffers; not
            ``sk.attention``'s flash kernels, ``program.flash``, nor ``sk.moe``'s grouped matmuls),
            ``"while"`` (a loop without a trip count), ``"recurrence"`` (a scan over
            activations that is not a layer scan: a time recurrence inside a layer),
            ``"relayout"`` (a slice or concatenation along a dim split over part of the tensor
            axis: ``head_splits``), ``"head-spill"`` (fewer heads than tensor devices).
        ragged: the program holds ragged-all-to-alls (``sk.moe``'s dropless dispatch), whose
            ``explicit`` bytes are the static bound of the routed rows (data-dependent).
        saved: the residuals the forward saves for the backward, ``[(aval, where)]`` as
            ``jax.ad_checkpoint.saved_residuals`` names them, read off the same trace
            (``trace``): what the pipeline memory model sizes (``leaf_sizes.residual_bytes``).
        kernels: ``(flops, bytes, executions)`` of each kernel the pass launches, per device:
            its matmul flops and the device-memory bytes it reads and writes
            (``kernel_traffic``), what the step-time roofline times.
    """

    lookup: list[bool]
    matmul: list[bool]
    conv: list[int]
    loop_use: list[bool]
    flops: float
    total_flops: float
    peak: float
    residuals: float
    tensor_reduce: float
    tensor_reduce_ops: float
    notes: list[str]
    explicit: dict = dataclasses.field(default_factory=dict)
    shard_maps: int = 0
    unseen: dict = dataclasses.field(default_factory=dict)
    row_syncs: tuple[int, float] = (0, 0.0)
    split_followed: bool = False
    moved: list[bool] = dataclasses.field(default_factory=list)
    ragged: bool = False
    saved: list = dataclasses.field(default_factory=list)
    weight_shard_maps: int = 0
    kernels: list = dataclasses.field(default_factory=list)
