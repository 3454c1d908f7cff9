"""Recipes built on shardkit's public API: ``models.transformer`` (GPT-style decoder)."""

import shardkit  # noqa: E402, F401  (first: it imports JAX without the CUDA plugin's start-up chatter)
