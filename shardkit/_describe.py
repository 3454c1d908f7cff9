"""``Plan.describe``: a table of every leaf's layout, printable as text and as HTML."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.sharding import Mesh, PartitionSpec as P

from .rules import entry_axes


def table(plan, model, opt_state=None) -> "_Table":
    """The rows of ``plan.describe(model, opt_state)``: each leaf's path, shape, dtype, spec,
    per-device shape and deciding rule, with what the plan leaves unused or dropped below."""
    notes = []
    if plan.unused_axes:
        notes.append(f"mesh axes left unused on purpose (their devices repeat the work, unless the step's own "
                     f"shard_map uses them): {list(plan.unused_axes)}")
    if plan._dropped:
        notes.append("AxisRules entries naming axes this mesh lacks, dropped (drop_missing=True): "
                     + "; ".join(plan._dropped))
    t = _Table(title=f"{plan} — per-leaf sharding", caption="\n".join(notes) or None)
    for col in ("path", "shape", "dtype", "spec", "per device", "source"):
        t.add_column(col)
    rows = plan.leaf_layouts(model)
    if opt_state is not None:
        u = plan._unpack(model)
        lay = plan._layout(u.params, u.logical, u.adapter.param_prefix, check=False)
        rows += [dataclasses.replace(l, path=f"opt_state/{l.path}")
                 for l in plan.opt_state_layouts(opt_state, u.params, lay)]
    for l in rows:
        t.add_row(l.path, str(l.shape), str(getattr(l.dtype, "name", l.dtype)), str(l.spec),
                  str(shard_shape(l.shape, l.spec, plan.mesh)), l.source + (f" — {l.note}" if l.note else ""))
    return t


try:
    from rich.table import Table as _RichTable
except ImportError:  # pragma: no cover - rich ships with flax
    _RichTable = object


class _Table(_RichTable):
    """A ``rich`` table that also prints as text with plain ``print`` and renders in notebooks."""

    def _export(self, html: bool) -> str:
        import io

        from rich.console import Console

        console = Console(file=io.StringIO(), width=160, record=True)
        console.print(self)
        return console.export_html(inline_styles=True) if html else console.export_text()

    def __str__(self) -> str:
        return self._export(html=False)

    def _repr_html_(self) -> str:
        return self._export(html=True)


def shard_shape(shape: Sequence[int], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """The per-device block shape of an array of ``shape`` laid out by ``spec``."""
    out = list(shape)
    for d, e in enumerate(spec):
        out[d] //= math.prod(mesh.shape[a] for a in entry_axes(e))
    return tuple(out)


