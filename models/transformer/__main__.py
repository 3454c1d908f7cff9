"""``python -m models.transformer [flags]``; ``shardkit train transformer`` calls ``main``."""

from .train import main as main

if __name__ == "__main__":
    raise SystemExit(main())
