"""Text data that needs no network: a byte-level corpus from Python's own standard library,
plus loaders for a user's token file or text files.

Batches come through a Grain pipeline (``dataset``): the corpus cut into windows of
``seq + 1`` tokens, shuffled globally with a new order each epoch, batched, each process
reading only its rows of the global batch (host-local loading; ``global_batch`` assembles the
global array). The iterator's state is a tiny JSON-able position (``Batches.position``) that
the recipe checkpoints beside the train state, so a resumed run sees exactly the batches it
would have seen.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
import zlib
from collections.abc import Sequence

import grain
import numpy as np

from ..common.loader import DataError as DataError
from ..common.loader import Loader, per_process_batches, process_share
from ..common.loader import global_batch as global_batch

VAL_EVERY = 20  # one file in 20 (by a hash of its path) goes to validation
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "lib2to3", "ensurepip", "turtledemo"}


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


class TokenWindows:
    """A Grain data source: window ``k`` is tokens ``[k·seq, k·seq + seq + 1)`` as
    ``{"inputs", "targets"}`` (int32, ``seq`` each), so the windows tile the corpus once per epoch.

    Args:
        tokens: 1-D token array (may be a memmap: only the windows read are loaded).
        seq: tokens per row.
    """

    def __init__(self, tokens: np.ndarray, seq: int):
        if len(tokens) <= seq + 1:
            raise DataError(f"{len(tokens)} tokens cannot fill one window of {seq + 1}")
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, k: int) -> dict:
        window = np.asarray(self.tokens[k * self.seq:k * self.seq + self.seq + 1]).astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


def dataset(tokens: np.ndarray, batch: int, seq: int, seed: int = 0, *, process_index: int | None = None,
            process_count: int | None = None) -> grain.MapDataset:
    """The Grain pipeline: windows shuffled globally (a new order each epoch), repeated
    forever, batched, this process's rows of each global batch; element ``s`` is step ``s``."""
    index, count = process_share(process_index, process_count)
    examples = grain.MapDataset.source(TokenWindows(tokens, seq)).shuffle(seed).repeat()
    return per_process_batches(examples, batch, index, count)


class Batches(Loader):
    """Training batches ``{"inputs", "targets"}`` (int32, rows × seq) through Grain.

    Each process loads only its rows of the global batch (rows ``[i·B/P, (i+1)·B/P)`` for
    process ``i`` of ``P``); ``position`` (JSON) resumes the stream exactly.

    Args:
        tokens: 1-D token array (may be a memmap).
        batch: global batch size (rows).
        seq: tokens per row.
        seed: shuffle seed.
        process_index, process_count: this host's share (default: JAX's).
        position, threads: see ``Loader``.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0, *,
                 process_index: int | None = None, process_count: int | None = None,
                 position: dict | None = None, threads: int = 2):
        super().__init__(dataset(tokens, batch, seq, seed, process_index=process_index,
                                 process_count=process_count),
                         seed=seed, position=position, threads=threads)


def eval_batches(tokens: np.ndarray, batch: int, seq: int, count: int, seed: int = 1234,
                 **kw) -> list[dict]:
    """A fixed list of ``count`` validation batches (same windows every evaluation)."""
    it = Batches(tokens, batch, seq, seed, threads=0, **kw)
    return [it.batch_at(i) for i in range(count)]


def describe(train: Sequence, val: Sequence, name: str) -> str:
    return f"{name}: {len(train):,} train / {len(val):,} validation tokens"
