"""Collectives inside a compiled program's ``conditional`` branches: where an SPMD program can
hang on real devices.

Every device runs the same program but evaluates a conditional's branch index itself. A
collective inside one branch waits for every device of its group; a device of that group that
took another branch never arrives, and the program deadlocks (on XLA:CPU the rendezvous times
out and aborts; on GPUs NCCL waits forever). ``sk.pipeline``'s explicit schedules run one
``lax.switch`` per tick whose branch index is read off the schedule table by pipeline stage:
every device of one stage takes the same branch, the stages different ones. A collective in
that switch is safe only if each of its device groups lies inside one stage (a tensor-parallel
sum within the stage); one whose group spans the pipe axis hangs. A collective-permute's group
is every device its pairs name (one rendezvous): a relayout between two compiler-owned axes
whose pairs each stay in a stage but name every device hangs too
(``docs/upstream/xla_partitioner_two_auto_axes.py``). Of any other conditional this reader
cannot tell which devices take which branch, so every collective in it is a hazard.
"""

from __future__ import annotations

import dataclasses

from ..._branches import EVEN_SCOPE, STAGE_SCOPE
from ...pipeline.schedules import EXPLICIT_SCOPE
from .hlo.collectives import collective_kind, op_name, participant_axes
from .hlo.text import callees, computations, innermost_scope


@dataclasses.dataclass(frozen=True)
class BranchCollective:
    """A collective op inside a ``conditional``'s branch, or in a computation a branch calls.

    Attributes:
        kind: the collective (``all-reduce``, ``collective-permute``, ...).
        axes: the mesh axes over which the devices that meet in it differ
            (``hlo.participant_axes``: for a permute, every device its pairs name).
        conditional: the conditional's instruction name.
        scope: the conditional's ``op_name`` (the named scopes of the JAX op it came from).
        branch: ``"<index>:<computation>"``, the branch it runs in.
        computation: the computation that holds the op (the branch, or one nested under it).
        op_name: the collective's own ``op_name``.
    """

    kind: str
    axes: tuple[str, ...]
    conditional: str
    scope: str
    branch: str
    computation: str
    op_name: str

    @property
    def pipeline_switch(self) -> bool:
        """Whether it sits in a switch whose branch index is the device's stage: ``sk.pipeline``'s
        per-tick switch, or a stage-local permute's (``_branches.STAGE_SCOPE``). The
        innermost of the scopes decides: a building block's switch inside a stage's branch
        (``_branches.EVEN_SCOPE``) branches by other coordinates."""
        return innermost_scope(self.scope, (EXPLICIT_SCOPE, STAGE_SCOPE, EVEN_SCOPE)) in (EXPLICIT_SCOPE, STAGE_SCOPE)

    def may_hang(self, pipe_axis: str | None) -> bool:
        """Whether devices of one of its groups can take different branches: it crosses the
        pipe axis of the pipeline's switch, or sits in any other conditional."""
        return not self.pipeline_switch or pipe_axis is None or pipe_axis in self.axes

    def __str__(self) -> str:
        over = ",".join(self.axes) or "no mesh axis"
        return (f"{self.kind} over {over} in {self.computation} (branch {self.branch} of "
                f"{self.conditional}, {self.scope or 'no op_name'}): {self.op_name or 'no op_name'}")


def branch_collectives(hlo: str, mesh_shape: dict[str, int]) -> list[BranchCollective]:
    """Every collective inside a conditional branch of ``hlo`` (post-partitioning text), nested
    calls included (fusions, loops, async wrappers, inner conditionals: an op under two
    conditionals is listed for each)."""
    comps, _ = computations(hlo)
    graph = {name: [c for line in lines for _, c in callees(line)] for name, lines in comps.items()}
    found = []
    for lines in comps.values():
        for line in lines:
            branches = [(role[6:] if role.startswith("branch") else role.split("_")[0], c)
                        for role, c in callees(line)
                        if role.startswith("branch") or role in ("true_computation", "false_computation")]
            if not branches:
                continue
            conditional = line.split("=", 1)[0].replace("ROOT", "").strip().lstrip("%")
            for index, branch in branches:
                for name in _reached(branch, graph):
                    for op_line in comps[name]:
                        kind = collective_kind(op_line)
                        if kind is not None:
                            found.append(BranchCollective(
                                kind, participant_axes(kind, op_line, mesh_shape), conditional, op_name(line),
                                f"{index}:{branch}", name, op_name(op_line)))
    return found


def _reached(start: str, graph: dict[str, list[str]]) -> list[str]:
    """``start`` and every computation it calls, transitively (each once)."""
    seen, todo = [], [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.append(name)
        todo.extend(graph[name])
    return seen
