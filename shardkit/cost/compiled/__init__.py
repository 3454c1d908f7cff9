"""Compiled figures: what XLA itself says a step costs.

``targets`` (the GPU and TPU compilers, deviceless), ``child`` (the subprocess that compiles),
``simulated`` (a step re-planned and compiled for a mesh that is not here), ``hlo/`` (reading a
compiled program's HLO text: its collectives and the mesh axes they span, its matmul flops),
``executable`` (a compiled
program read into a report), ``report`` (``sk.Report``: the compiled figures, printed beside
the estimate and its band) and ``bands`` (the measured error bands of the estimate). Nothing here imports the analytic model: the estimate is set beside a
report by ``shardkit.cost.beside``.
"""
