"""The analytic estimate: per-device memory, collective bytes, flops and step time, modelled.

``roles`` (one formula per collective role and memory kind), fed by a ``ModelShape``
(``from_shape``, with ``diloco_cost``: what DiLoCo's outer sync adds) or by a real step
(``from_step``, with ``leaf_sizes``: each leaf's resolved spec); ``pipeline_cost`` and ``pipeline_memory`` (what ``sk.pipeline`` costs),
``gpu_combining`` (how XLA:GPU combines the collectives), ``caveats`` (what an estimate cannot
see) and ``steptime`` (seconds from flops and bytes). Reads the traced program through
``shardkit.cost.program``; never the compiled figures.
"""
