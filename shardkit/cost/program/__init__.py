"""Reading the traced program: what the jaxpr of ``value_and_grad`` says about a step.

``reader`` (``read_program``: traces the pass once) walks it once with ``walker``, which owns
the recursion through nested jaxprs (trip counts, manual axes, parameter origins, consumer
tables) and hands each equation to the visitors: the reader itself (flops, which parameter is
used how, ``tensor_splits``: matmul tensor-split rules, ``head_splits``: a split feature
reshaped into heads, ``liveness``: the buffers alive and their peak, ``flash``: the kernels it
counts), ``row_syncs`` (reductions over the batch rows the backward waits for),
``gather_or_move`` (whether XLA gathers a weight or moves an activation) and ``explicit`` (the
collectives a ``shard_map`` writes itself). Beside them: ``walk`` (what an equation holds:
nested jaxprs, matmul flops), ``op_kinds`` (the primitive classes), ``findings``
(``ProgramReading``, what the reader hands on) and ``cpu_buffers`` (what XLA:CPU keeps beyond
the program). Imports nothing else of ``shardkit.cost``.
"""
