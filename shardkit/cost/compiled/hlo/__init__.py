"""Reading a compiled program's post-partitioning HLO text, counted as executed (an op inside a
``while`` body as many times as the loop runs).

``text`` (the computations and how often each runs; shape bytes), ``collectives`` (the
collectives executed and the mesh axes they span), ``permutes`` (which collectives' results a
``collective-permute`` moves) and ``matmuls`` (the matmul flops). ``sk.Report`` is built on these.
"""

from .collectives import (COLLECTIVES as COLLECTIVES, Collective as Collective, Traffic as Traffic,
                          collectives_from_hlo as collectives_from_hlo, traffic_from_hlo as traffic_from_hlo)
from .matmuls import matmul_flops_from_hlo as matmul_flops_from_hlo, rewritten_matmuls as rewritten_matmuls
from .text import HloParseError as HloParseError, shape_bytes as shape_bytes
