"""Text data that needs no network: a byte-level corpus from Python's own standard library,
plus loaders for a user's token file or text files.

Batches are random windows drawn with a generator seeded by ``(seed, step)``, so the stream
is deterministic and resumable from a tiny JSON-able position (``Batches.position()``), and
every process can compute the global batch's window offsets and load only its own rows
(host-local loading; ``global_batch`` assembles the global array).
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
import zlib
from collections.abc import Iterator, Sequence

import jax
import numpy as np

VAL_EVERY = 20  # one file in 20 (by a hash of its path) goes to validation
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "lib2to3", "ensurepip", "turtledemo"}


class DataError(ValueError):
    """A data source that cannot be used (missing file, bad dtype, token ids ≥ vocab)."""


def stdlib_files(root: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The standard library's ``.py`` files (tests and site-packages left out), sorted."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out.extend(pathlib.Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int = 16 << 20) -> tuple[np.ndarray, np.ndarray]:
    """The byte-level (vocab 256) corpus: (train, validation) uint8 token arrays.

    Text ships with every Python install, so this needs no download. Whole files are split
    between train and validation by a hash of their path, so the two never share a file.
    The exact bytes depend on the Python version installed.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        data = f"# ==== {rel} ====\n".encode() + path.read_bytes() + b"\n"
        parts[zlib.crc32(rel.encode()) % VAL_EVERY == 0].append(data)
        total += len(data)
        if total >= max_bytes:
            break
    train, val = (np.frombuffer(b"".join(parts[k]), dtype=np.uint8) for k in (False, True))
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"found no standard-library text under {root}")
    return train, val


def load_tokens(path: str | os.PathLike, *, fmt: str = "auto", vocab: int | None = None,
                val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """A user's corpus as (train, validation) token arrays (the last ``val_fraction``
    of the file is validation).

    Args:
        path: a flat binary of token ids (``.bin``/``.u16`` → uint16, ``.u32`` → uint32,
            memory-mapped) or any text file (read as bytes, vocab 256).
        fmt: ``"auto"`` (by extension), ``"uint16"``, ``"uint32"`` or ``"text"``.
        vocab: if given, every token id must be below it.

    Raises:
        DataError: the file is missing, empty, of a size not a multiple of the dtype, or
            holds ids ≥ vocab.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    if fmt == "auto":
        fmt = {".bin": "uint16", ".u16": "uint16", ".u32": "uint32"}.get(path.suffix, "text")
    if fmt == "text":
        tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    elif fmt in ("uint16", "uint32"):
        itemsize = np.dtype(fmt).itemsize
        if path.stat().st_size % itemsize:
            raise DataError(f"data file {str(path)!r} has {path.stat().st_size} bytes, not a "
                            f"multiple of {itemsize} ({fmt}); is the format right?")
        tokens = np.memmap(path, dtype=fmt, mode="r")
    else:
        raise DataError(f"data format {fmt!r} is not one of auto, text, uint16, uint32")
    if len(tokens) < 64:
        raise DataError(f"data file {str(path)!r} holds only {len(tokens)} tokens")
    if vocab is not None and (top := int(tokens.max())) >= vocab:
        raise DataError(f"data file {str(path)!r} has token id {top} but the model's vocab is "
                        f"{vocab}; raise the vocab or check the format ({fmt})")
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


class Batches(Iterator[dict]):
    """Random windows of ``seq + 1`` tokens as ``{"inputs", "targets"}`` (int32, B×T).

    Window offsets for step ``n`` come from ``np.random.default_rng((seed, n))``: any
    step can be reproduced without replaying the ones before it. Each process loads only its
    rows of the global batch (rows ``[i·B/P, (i+1)·B/P)`` for process ``i`` of ``P``).

    Args:
        tokens: 1-D token array (may be a memmap).
        batch: global batch size (rows).
        seq: tokens per row.
        seed: stream seed.
        process_index, process_count: this host's share (default: JAX's).
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0, *,
                 process_index: int | None = None, process_count: int | None = None):
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if batch % self.process_count:
            raise DataError(f"global batch {batch} is not divisible by {self.process_count} processes")
        if len(tokens) <= seq + 1:
            raise DataError(f"{len(tokens)} tokens cannot fill one window of {seq + 1}")
        self.step = 0

    def position(self) -> dict:
        """The stream position, JSON-able; ``restore()`` continues from it."""
        return {"seed": self.seed, "step": self.step}

    def restore(self, position: dict) -> None:
        self.seed, self.step = int(position["seed"]), int(position["step"])

    def batch_at(self, step: int) -> dict:
        """This process's rows of the global batch for ``step``."""
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - self.seq - 1, size=self.batch)
        rows = self.batch // self.process_count
        mine = starts[self.process_index * rows:(self.process_index + 1) * rows]
        windows = np.stack([np.asarray(self.tokens[s:s + self.seq + 1]) for s in mine])
        windows = windows.astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def __next__(self) -> dict:
        out = self.batch_at(self.step)
        self.step += 1
        return out


def eval_batches(tokens: np.ndarray, batch: int, seq: int, count: int, seed: int = 1234,
                 **kw) -> list[dict]:
    """A fixed list of ``count`` validation batches (same windows every evaluation)."""
    it = Batches(tokens, batch, seq, seed, **kw)
    return [it.batch_at(i) for i in range(count)]


def global_batch(local: dict, sharding: jax.sharding.Sharding | None) -> dict:
    """Host-local rows → global arrays. One process: the numpy batch as is (the train step
    places it); several: ``jax.make_array_from_process_local_data`` with ``sharding``."""
    if jax.process_count() == 1 or sharding is None:
        return local
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)


def describe(train: Sequence, val: Sequence, name: str) -> str:
    return f"{name}: {len(train):,} train / {len(val):,} validation tokens"
