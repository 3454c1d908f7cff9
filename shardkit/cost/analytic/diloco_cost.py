"""What DiLoCo adds to a layout's estimate (``Layout.replica > 1``): its outer sync over
``replica`` every ``diloco_every`` steps and the outer optimizer's memory, on top of one
replica's inner step (``from_shape.estimate`` estimates that, then hands it here).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...precision import Precision
from .. import hardware as hw_lib
from ..terms import Estimate, Layout, ModelShape
from .steptime import collective_time, efficiency_for, link


def diloco_terms(inner: Estimate, ms: ModelShape, lo: Layout, hw: hw_lib.Hardware, prec: Precision,
                 global_batch: int) -> Estimate:
    """A DiLoCo layout's estimate from its inner layout's (``inner``, one replica's step on
    1/replica of the batch): every ``diloco_every`` steps each device all-reduces its shard of
    Δ = θ_outer − θ_r in f32 over ``replica`` (the outer update's layout: sharded like ZeRO-1's
    optimizer state), on the link the replica axis crosses, with no compute to hide behind
    (Douillard et al. 2023, arXiv:2311.08105; Streaming DiLoCo's overlap is not modelled). The
    outer parameters and the outer Nesterov momentum add two such shards of memory."""
    p_dev = (ms.layer_params / (lo.tensor * lo.pipe) + (ms.params - ms.layer_params) / lo.tensor)
    shard = p_dev / (lo.fsdp * (lo.data if lo.zero >= 1 else 1))
    bp, bo = (np.dtype(d).itemsize for d in (prec.params, prec.opt_state))
    sync_bytes = 4.0 * shard
    bw, lat, group = link(hw, lo, ("replica",))
    sync_s = collective_time("all-reduce", sync_bytes, group, bw, lat) + efficiency_for(hw).latency
    mem = dict(inner.memory)
    outer = shard * (bp + bo)
    mem["opt_state"] += outer
    mem["arguments"] += outer
    mem["peak"] += outer
    col = dict(inner.collectives)
    col["replica-reduce"] = sync_bytes / lo.diloco_every
    t = dict(inner.time)
    t["replica-reduce"] = sync_s / lo.diloco_every
    t["exposed"] += t["replica-reduce"]
    t["step"] += t["replica-reduce"]
    notes = list(inner.notes) + [f"DiLoCo: replica={lo.replica} syncs {sync_bytes / 1e6:.1f} MB per device every "
                                 f"{lo.diloco_every} steps ({sync_s * 1e3:.1f} ms on its link)"]
    return dataclasses.replace(inner, memory=mem, collectives=col, time=t, layout=lo, tokens=global_batch * ms.seq,
                               devices=lo.devices, notes=notes)
