"""Layout search: ``candidates`` (every layout of a model on N devices the search considers),
``rank`` (them by estimated step time, optionally verified by compiling the best) and ``plan_cli`` (the ``shardkit plan`` command)."""
