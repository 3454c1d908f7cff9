"""Model adapters: plain pytrees, Flax NNX modules and Linen variable dicts, one interface.

Internally every model is two plain trees — trainable ``params`` and non-trainable
``model_state`` (BatchNorm statistics, RNG counters) — plus the logical axis names its
variables carry. The adapter rebuilds what the user's loss expects from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from .rules import path_str

try:  # Linen is optional at import time; NNX is flax's main API
    import flax.linen as nn
    _AxisMetadata = nn.meta.AxisMetadata
except ImportError:  # pragma: no cover
    nn, _AxisMetadata = None, ()


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How to turn ``(params, model_state)`` back into what the loss function takes.

    Attributes:
        kind: ``"pytree"``, ``"nnx"`` or ``"linen"``.
        graphdef: the NNX graph definition (static structure), for ``"nnx"``.
        param_prefix: prefix of parameter paths for rules (``"params/"`` for Linen).
    """

    kind: str
    graphdef: Any = None
    param_prefix: str = ""

    def assemble(self, params, model_state):
        if self.kind == "nnx":
            return nnx.merge(self.graphdef, params, model_state)
        if self.kind == "linen":
            return {"params": params, **model_state}
        return params

    def harvest(self, model, model_state):
        """The model state after the loss ran (NNX modules mutate in place)."""
        if self.kind == "nnx" and model_state:
            _, _, rest = nnx.split(model, nnx.Param, ...)
            return nnx.to_pure_dict(rest)
        return model_state


@dataclasses.dataclass(frozen=True)
class Unpacked:
    """A model split into plain trees plus per-path logical names."""

    adapter: Adapter
    params: Any
    model_state: Any
    logical: dict[str, tuple]  # path -> logical axis names, for leaves that carry them
    overwrite: frozenset = frozenset()  # paths of parameters whose gradient is their new value (sk.fp8)


def is_linen_variables(obj) -> bool:
    return (isinstance(obj, Mapping) and "params" in obj
            and all(isinstance(v, Mapping) for v in obj.values()))


def _names_of(leaf) -> tuple | None:
    if isinstance(leaf, nnx.Variable):
        meta = leaf.get_metadata()
        for key in ("out_sharding", "sharding_names", "sharding"):
            names = meta.get(key)
            if names:
                return tuple(names)
        return None
    if _AxisMetadata and isinstance(leaf, _AxisMetadata):
        names = getattr(leaf, "names", None)
        return tuple(names) if names else None
    return None


def _is_boxed(x) -> bool:
    return isinstance(x, nnx.Variable) or bool(_AxisMetadata) and isinstance(x, _AxisMetadata)


def _logical(tree, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_boxed)[0]:
        names = _names_of(leaf)
        if names is not None:
            out[prefix + path_str(keypath)] = names
    return out


def _unbox(tree):
    def one(x):
        if isinstance(x, nnx.Variable):
            return x.get_value() if hasattr(x, "get_value") else x[...]
        if _AxisMetadata and isinstance(x, _AxisMetadata):
            return x.unbox()
        return x
    return jax.tree.map(one, tree, is_leaf=_is_boxed)


def _overwritten(params) -> frozenset:
    """Paths of the NNX parameters whose class sets ``overwrite_with_gradient`` (``sk.fp8``'s
    amax histories): the step writes their gradient over them instead of optimizing them."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_boxed)[0]
    return frozenset(path_str(k) for k, v in leaves if getattr(type(v), "overwrite_with_gradient", False))


def unpack(model) -> Unpacked:
    """Splits a model (NNX module or State, Linen variables, or plain pytree) into plain trees."""
    if isinstance(model, nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        # Paths are unique across a module's variables, so one table serves params and state.
        return Unpacked(Adapter("nnx", graphdef), nnx.to_pure_dict(params), nnx.to_pure_dict(rest),
                        {**_logical(params), **_logical(rest)}, _overwritten(params))
    if isinstance(model, nnx.State):
        return Unpacked(Adapter("pytree"), nnx.to_pure_dict(model), {}, _logical(model))
    if is_linen_variables(model):
        params = model["params"]
        rest = {k: v for k, v in model.items() if k != "params"}
        logical = _logical(params, "params/")
        for k, v in rest.items():
            logical.update(_logical(v, f"{k}/"))
        return Unpacked(Adapter("linen", param_prefix="params/"), _unbox(dict(params)),
                        {k: _unbox(dict(v)) for k, v in rest.items()}, logical)
    return Unpacked(Adapter("pytree"), _unbox(model), {}, _logical(model))
