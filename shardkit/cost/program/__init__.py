"""Reading the traced program: what the jaxpr of ``value_and_grad`` says about a step.

``reader`` (``read_program``: liveness and peak, flops, which parameter is used how) with its
rules: ``walk`` (the nested jaxprs, trip counts, manual axes), ``op_kinds`` (the primitive
classes), ``findings`` (``ProgramReading``, what the reader hands on), ``tensor_splits``
(matmul tensor-split rules), ``head_splits`` (a split feature reshaped into heads),
``row_syncs`` (reductions over the batch rows the backward waits for), ``gather_or_move``
(whether XLA gathers a weight or moves an activation) and ``cpu_buffers`` (what XLA:CPU keeps
beyond the program). Imports nothing else of ``shardkit.cost``.
"""
