"""Where XLA may move activations instead of gathering a ZeRO-3/FSDP-sharded weight (or, for a
tensor-split one, instead of reducing its partial sums: ``caveats`` reads both).

The SPMD partitioner meets a matmul or convolution whose weight is sharded over the data axes
(ZeRO-3, FSDP) and whose activation is split over the same axes on its batch. The formulas
assume it all-gathers the weight; it may instead all-gather the activation over the batch and
compute a slice of the output channels with the weight's local shard, leaving the weight's
gradient local too (no grad-reduce for it). Seen on flaxmodels' ResNet-18 at 16x16 images
compiled for data=8 H100s at ZeRO-3: the 2x2 and 1x1 stages' 3x3 kernels (147k-2.4M elements)
stayed sharded while their inputs (32 rows x 2x2x128, 16k elements) were gathered — grad-reduce
1.36 MB and param-gather 2.0 MB against 44.7 and 89 MB estimated. The 4x4 stage (input 32k
elements, kernel 37k) and the stem were gathered as weights. The choice is the partitioner's
cost model; this module only finds the weights where it is plausible — a matmul whose input
and output together hold fewer elements than the weight — for a caveat (``caveats``), not a
figure.
"""

from __future__ import annotations

import math

from jax._src import core as jcore

from .walker import Frame, Visitor
from .op_kinds import MATMUL


class ActivationsSmaller(Visitor):
    """The ``Walker`` visitor: per parameter leaf (``moved``), whether some matmul or
    convolution reading it has an input and an output that together hold fewer elements
    (global) than the weight it reads."""

    def __init__(self, n_params: int):
        self.moved = [False] * n_params

    def equation(self, state, frame: Frame, i: int, e, subs: list):
        if e.primitive.name in MATMUL and len(e.invars) >= 2:
            src = frame.source(e)
            for side in (0, 1):
                w, a = e.invars[side], e.invars[1 - side]
                if src[side] is not None and src[1 - side] is None and not isinstance(a, jcore.Literal):
                    moved = math.prod(a.aval.shape) + math.prod(e.outvars[0].aval.shape)
                    self.moved[src[side]] |= moved < math.prod(w.aval.shape)
        return None
