"""Layout search: ``rank`` (every layout of a model on N devices, by estimated step time, and
optionally verified by compiling the best) and ``plan_cli`` (the ``shardkit plan`` command)."""
