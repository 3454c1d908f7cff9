"""Recipes built on shardkit's public API: ``models.transformer`` (GPT-style decoder)."""
