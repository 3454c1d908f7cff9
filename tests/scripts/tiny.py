"""A tiny MLP, its plans and a deterministic data stream, shared by the checkpoint tests and the
subprocess scripts beside it (which set their own device count before importing JAX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardkit as sk

SPECS = [(r"w1", ("fsdp", "tensor")), (r"w2", ("tensor", "fsdp")), (r".*", ())]
D_IN, D_HID, D_OUT, BATCH = 16, 32, 8, 16


def make_step(mesh_spec: str = "data=8", zero: int = 0, **kw):
    """``(plan, step)`` for the tiny MLP on ``mesh_spec`` (axes from data/fsdp/tensor)."""
    mesh = sk.make_mesh(mesh_spec)
    rules = [(r, tuple(a if a in mesh.shape else None for a in spec)) for r, spec in SPECS]
    plan = sk.Plan(mesh, rules=sk.PathRules(rules), zero=zero)

    @sk.train_step(plan, optax.adam(1e-2), **kw)
    def step(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None, :])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    return plan, step


def init_params(key, d_hid: int = D_HID):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (D_IN, d_hid)) * 0.3, "b1": jnp.zeros((d_hid,)),
            "w2": jax.random.normal(k2, (d_hid, D_OUT)) * 0.3}


def batch(i: int, rows: slice = slice(None)) -> dict:
    """Batch number ``i`` of the stream (a pure function of ``i``: the data position is ``i``)."""
    rng = np.random.default_rng(1000 + i)
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = np.sin(x[:, :D_OUT]).astype(np.float32)
    return {"x": x[rows], "y": y[rows]}
