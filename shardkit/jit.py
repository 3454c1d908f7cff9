"""``sk.jit``: ``jax.jit`` whose shardings come from a ``Plan``, for hand-written steps.

Each positional argument (and each output) is given a *role*; the plan turns roles into
shardings once it sees the arguments' shapes:

- ``"params"``: the plan's parameter specs (ZeRO-3 adds the data axes);
- ``"grads"``: the gradient layout (ZeRO-2/3 shard over the data axes);
- ``"opt_state"``: Optax state laid out like the ``"params"`` argument (ZeRO-1+ shards it);
- ``"batch"``: leading dimension over the batch axes (divisibility checked);
- ``"replicated"``: every device holds all of it;
- ``None``: left to the compiler (outputs) or to the argument's own sharding (inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from . import _axes
from .plan import Plan
from .rules import spec_axes

ROLES = ("params", "grads", "opt_state", "batch", "replicated", None)


class PlannedJit:
    """A plan-sharded jitted function; call it, or ``.lower(*args)``."""

    def __init__(self, fn: Callable, plan: Plan, args: Sequence[str | None], out, donate: Sequence[int]):
        for r in list(args) + (list(out) if isinstance(out, (tuple, list)) else [out]):
            if r not in ROLES:
                raise ValueError(f"unknown sharding role {r!r}; roles are {ROLES}")
        if list(args).count("opt_state") and "params" not in args:
            raise ValueError("an 'opt_state' argument is laid out like the 'params' argument; mark one argument 'params'")
        self.fn, self.plan, self.args, self.out, self.donate = fn, plan, tuple(args), out, tuple(donate)
        self._cache: dict = {}
        self._used: set[str] = set()  # mesh axes the arguments' shardings use

    def _shardings_for(self, role, value, params):
        plan = self.plan
        if role is None:
            return None
        if role == "replicated":
            return jax.tree.map(lambda _: plan.sharding(P()), value)
        if role == "batch":
            return plan.batch_shardings(value)
        if role == "params":
            return plan.param_shardings(value)
        if role == "grads":
            return plan.shardings(plan.grad_specs(value))
        return plan.shardings(plan.opt_state_specs(value, params))

    def _jitted(self, args):
        if len(args) != len(self.args):
            raise ValueError(f"{self.fn.__name__} was given {len(args)} arguments but sk.jit has {len(self.args)} roles {self.args}")
        key = tuple(jax.tree.structure(a) for a in args) + tuple(
            tuple(getattr(x, "shape", ())) for a in args for x in jax.tree.leaves(a))
        if key not in self._cache:
            params = next((a for a, r in zip(args, self.args) if r == "params"), None)
            in_sh = tuple(self._shardings_for(r, a, params) for r, a in zip(self.args, args))
            self._used.update(a for sh in jax.tree.leaves(in_sh) for a in spec_axes(sh.spec))
            out_sh = None
            if self.out is not None:
                with self.plan.active():
                    out_shape = jax.eval_shape(self.fn, *args)
                if isinstance(self.out, (tuple, list)):
                    out_sh = tuple(self._shardings_for(r, o, params) for r, o in zip(self.out, out_shape))
                else:
                    out_sh = self._shardings_for(self.out, out_shape, params)
            self._cache[key] = jax.jit(self._checked, in_shardings=in_sh, out_shardings=out_sh,
                                       donate_argnums=self.donate)
        return self._cache[key]

    def _checked(self, *args):
        """``fn`` traced with every mesh axis checked for a use (a mesh axis nothing uses is an
        error, before compiling)."""
        with _axes.checking_axes(self.plan, self._used):
            return self.fn(*args)

    def lower(self, *args) -> jax.stages.Lowered:
        with self.plan.active():
            return self._jitted(args).lower(*args)

    def __call__(self, *args):
        jitted = self._jitted(args)
        with self.plan.active():
            return jitted(*args)


def jit(fn: Callable | None = None, plan: Plan | None = None, *, args: Sequence[str | None] = ("params", "batch"),
        out=None, donate: Sequence[int] = ()):
    """Compiles ``fn`` with shardings taken from ``plan`` by argument role.

    Args:
        fn: the function (or omit it to use ``sk.jit(plan=..., ...)`` as a decorator).
        plan: the ``sk.Plan``.
        args: one role per positional argument (see the module docstring).
        out: a role, or a tuple of roles, for the outputs; None lets the compiler choose.
        donate: positions of arguments whose buffers the outputs may reuse.

    Returns:
        A ``PlannedJit``: call it like ``fn``; ``.lower(*args)`` gives JAX's ``Lowered``.

    Raises:
        ValueError: an unknown role, or an argument count that does not match ``args``.
        ShardingError: the plan's rules do not fit the arguments.
    """
    if plan is None:
        raise ValueError("sk.jit needs a plan: sk.jit(fn, plan, args=(...))")
    if fn is None:
        return lambda f: PlannedJit(f, plan, args, out, donate)
    return PlannedJit(fn, plan, args, out, donate)
