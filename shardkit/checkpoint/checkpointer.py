"""Checkpoints on Orbax: save a sharded ``TrainState`` from every host, restore it onto any plan.

A checkpoint is a plain Orbax ``CheckpointManager`` directory: one subdirectory per step with three
items, ``state`` (the whole ``TrainState`` as a ``StandardSave`` pytree: every host writes its own
shards, nothing is gathered), ``extra`` (a JSON dict: data-iterator position, config) and
``checksums`` (JSON: one checksum per array, and one of ``extra``). Restores always go through an
abstract target carrying the *new* plan's shardings, so a checkpoint saved on ``data=8`` ZeRO-0
loads onto ``fsdp=4,tensor=2`` ZeRO-3 (Orbax reads each device's slice), and never silently onto
the mesh it was saved with.

Safety comes from Orbax's atomic commit (a save is written to ``<step>.orbax-checkpoint-tmp-*``
and renamed when complete; old steps are deleted only after that), plus checks here: non-finite
states are refused, a checkpoint whose tree or shapes differ from the target is reported leaf by
leaf before anything is read, and every array read back is checked against its checksum before
``restore`` returns (Orbax and TensorStore verify their index, not array data: a flipped bit in a
chunk would otherwise come back as a wrong number). ``fallback=True`` goes back to the newest
intact step and never touches the damaged one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import signal
import threading
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..plan import Plan

log = logging.getLogger("shardkit.checkpoint")

_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked (the message says why and what to do)."""


class CorruptCheckpointError(CheckpointError):
    """A saved step is damaged: an array's checksum differs, a file is missing or truncated, an
    array is missing, or its metadata is unreadable.

    Attributes:
        directory: the checkpoint directory.
        step: the damaged step (left exactly as it is on disk).
        problems: ``((leaf path, what is wrong), ...)``; the path is ``""`` when the damage is to
            something all arrays share (the step's index or metadata).
    """

    def __init__(self, directory: str, step: int, problems: list[tuple[str, str]], steps: list[int]):
        self.directory, self.step, self.problems = directory, step, tuple(problems)
        lines = "\n".join(f"  {leaf or '(the whole step)'}: {what}" for leaf, what in problems)
        older = [s for s in steps if s < step]
        alt = (f"restore(..., fallback=True) / resume(..., fallback=True) go back to the newest intact step "
               f"(older complete steps: {older})" if older else "no older step to fall back to: start without resuming")
        super().__init__(
            f"checkpoint step {step} in {directory} is corrupt:\n{lines}\n{alt}. shardkit never deletes or "
            f"changes a damaged step: inspect {os.path.join(directory, str(step))}, then delete it yourself.")


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """What the last ``restore``/``resume`` of a ``Checkpointer`` read.

    Attributes:
        step: the step whose state (and extra) was returned.
        verified: True if every array matched its saved checksum; False for a checkpoint written
            before checksums existed (or with ``checksums=False``), restored unverified.
        skipped: ``((step, problems), ...)`` for newer steps that ``fallback=True`` passed over
            because they are corrupt (newest first); empty when the asked-for step was intact.
    """

    step: int
    verified: bool
    skipped: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_paths(tree) -> dict[str, Any]:
    """``{"params/w": leaf, ...}``: leaves by slash-joined path, as Orbax names them on disk.

    Dataclass fields, dict keys, named-tuple fields and sequence indices all become path parts,
    so a ``TrainState`` and the nested dicts/lists Orbax's metadata returns line up.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_str(k) for k in path): leaf for path, leaf in flat}


def _flags_fn(xs):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])


_finite_flags = jax.jit(_flags_fn)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` holding a NaN or an infinity.

    One jitted reduction over the (possibly sharded, multi-host) arrays; every process must call
    it, as with any computation on global arrays.
    """
    leaves = leaf_paths(tree)
    names, arrays, bad = [], [], []
    for name, x in leaves.items():
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            continue
        if isinstance(x, jax.Array):
            names.append(name)
            arrays.append(x)
        elif not np.all(np.isfinite(np.asarray(x))):
            bad.append(name)
    if arrays:
        flags = np.asarray(_finite_flags(arrays))
        bad += [n for n, ok in zip(names, flags) if not ok]
    return bad


def _describe(x) -> str:
    return f"{tuple(x.shape)} {np.dtype(x.dtype).name}" if hasattr(x, "shape") else type(x).__name__


def tree_mismatches(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """One line per leaf that is missing, unexpected, or shaped differently (saved vs expected)."""
    lines = []
    for name in sorted(set(saved) | set(expected)):
        if name not in saved:
            lines.append(f"  {name}: expected {_describe(expected[name])}, not in the checkpoint")
        elif name not in expected:
            lines.append(f"  {name}: in the checkpoint ({_describe(saved[name])}), not in the target")
        elif tuple(saved[name].shape) != tuple(expected[name].shape):
            lines.append(f"  {name}: saved {tuple(saved[name].shape)}, expected {tuple(expected[name].shape)}")
    return lines


# ---- integrity: one layout-independent checksum per array ------------------------------------
#
# A checksum keyed by the shards a save wrote can only be checked by a restore that reads the
# same shards, but a restore onto another mesh reads other slices. So each array gets one
# additive checksum instead (Bellare & Micciancio, "A New Paradigm for Collision-free Hashing:
# Incrementality at Reduced Cost", EUROCRYPT 1997): the sum, mod 2**32, of a bijective mix of
# each 32-bit word keyed by its global position, in two independent lanes. Sums do not depend on
# the order of addition, so every device sums the words it holds, XLA adds the partial sums
# across devices and hosts (8 bytes per array cross the network, never the array), and the value
# is the same for any layout. One changed word always changes both lanes (each term is a
# bijection of the word); random damage to several words goes unnoticed with probability ~2**-64.

_RECORD = "checksums"  # the Orbax item beside "state" and "extra"
_FORMAT = "shardkit.checksums/1"
_MAX_BLOCKS = 256  # per array in the record: beyond that, naming the block is not worth the bytes
_U32 = np.uint32


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (Appleby, 2011): a bijection spreading each bit over all."""
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(dtype) -> int | None:
    """Bits per element of a dtype the checksum covers, or None (e.g. PRNG key arrays)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    if dtype == np.bool_:
        return 8
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return 8 * dtype.itemsize
    for kind, info in ((jnp.integer, jnp.iinfo), (jnp.floating, jnp.finfo)):
        if jnp.issubdtype(dtype, kind):
            bits = info(dtype).bits
            return bits if bits <= 8 or bits in (16, 32, 64) else None
    return None


def _words(x):
    """The bits of ``x`` as uint32, shape ``x.shape + (words per element,)``, value-exact."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(jnp.uint32)[..., None]
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)).reshape(x.shape + (-1,))
    bits = _bits(dtype)
    if bits < 8:  # int4 / float4 have no byte to reinterpret; their values convert exactly
        return _words(x.astype(jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else jnp.int32))
    word = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[bits]
    return lax.bitcast_convert_type(x, word).astype(jnp.uint32).reshape(x.shape + (-1,))


def _leaf_digest(x, starts=None, shape=None):
    """``uint32[2]``: the two lanes of the checksum of ``x``, a block of an array of ``shape``
    starting at ``starts`` (default: all of it)."""
    shape = x.shape if shape is None else shape
    w = _words(x)
    flat, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for d in reversed(range(x.ndim)):
        i = lax.broadcasted_iota(jnp.uint32, x.shape, d)
        if starts is not None:
            i = i + starts[d].astype(jnp.uint32)
        flat = flat + i * _U32(stride % 2**32)
        stride *= shape[d]
    pos = flat[..., None] * _U32(w.shape[-1]) + lax.broadcasted_iota(jnp.uint32, w.shape, x.ndim)
    a = _fmix32(w ^ (pos * _U32(0x9E3779B1) + _U32(0x7F4A7C15)))
    b = _fmix32(w * _U32(0x27D4EB2F) + ((pos * _U32(0xCC9E2D51)) ^ _U32(0x165667B1)))
    return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


def _spec_axes(spec, ndim: int) -> list[tuple[str, ...]]:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [() if e is None else tuple(e) if isinstance(e, (tuple, list)) else (e,) for e in entries]


def _evenly_sharded(x) -> bool:
    s = x.sharding
    if len(s.spec) > x.ndim:
        return False
    return all(n % int(np.prod([s.mesh.shape[a] for a in axes])) == 0
               for n, axes in zip(x.shape, _spec_axes(s.spec, x.ndim)))


@dataclasses.dataclass(frozen=True)
class _Digest:
    """One array's checksum: ``total`` (any layout), and for a ``NamedSharding`` array the
    checksum of each block (``"0:8,0:512"``) and blocks whose copies on two hosts differ."""

    total: str
    blocks: dict[str, str] | None = None
    disagreements: tuple[str, ...] = ()


def _hex(lanes) -> str:
    return f"{int(lanes[0]):08x}{int(lanes[1]):08x}"


@functools.lru_cache(maxsize=1024)
def _block_layout(mesh, spec, shape: tuple) -> tuple[tuple[str, bool, bool, int], ...]:
    """Per device of ``mesh`` (in ``mesh.devices`` order): ``(block, first copy of the block,
    first copy on its process, process)`` for an array of ``shape`` sharded as ``spec``."""
    axes = _spec_axes(spec, len(shape))
    out, seen, seen_here = [], set(), set()
    for coords in np.ndindex(mesh.devices.shape):
        at = dict(zip(mesh.axis_names, coords))
        parts = []
        for n, dim_axes in zip(shape, axes):
            index, count = 0, 1
            for ax in dim_axes:
                index, count = index * mesh.shape[ax] + at[ax], count * mesh.shape[ax]
            parts.append(f"{index * (n // count)}:{(index + 1) * (n // count)}")
        block, proc = ",".join(parts), mesh.devices[coords].process_index
        out.append((block, block not in seen, (block, proc) not in seen_here, proc))
        seen.add(block)
        seen_here.add((block, proc))
    return tuple(out)


def _combine(layout, rows: np.ndarray) -> _Digest:
    """``rows[device] = (lane a, lane b)`` as computed by each device of ``layout`` (zeros where
    it computed nothing) -> the array's checksum, its blocks', and every block whose copy on
    some process differs from the first copy (each process hashed what it read)."""
    first = {block: rows[i] for i, (block, is_first, _, _) in enumerate(layout) if is_first}
    total = np.sum(np.stack(list(first.values())).astype(np.uint64), axis=0) % 2**32
    differ = [f"block [{block}] as read by process {proc}" for i, (block, is_first, here, proc) in enumerate(layout)
              if here and not is_first and tuple(rows[i]) != tuple(first[block])]
    return _Digest(_hex(total), {block: _hex(v) for block, v in first.items()}, tuple(differ))


_digest_fns: dict[Any, Any] = {}


def _sharded_digest_fn(mesh, specs: tuple, shapes: tuple):
    """One program for a group of arrays on ``mesh``: each device hashes its block of each
    array if it holds the first copy of that block on its process (a block replicated on 8
    devices of a host is hashed once there), and returns its sums: ``uint32[devices, n, 2]``."""
    key = (mesh, specs, shapes)
    if key in _digest_fns:
        return _digest_fns[key]
    masks = [np.array([here for _, _, here, _ in _block_layout(mesh, spec, shape)]).reshape(mesh.devices.shape)
             for spec, shape in zip(specs, shapes)]

    def body(*blocks):
        at = tuple(lax.axis_index(ax) for ax in mesh.axis_names)
        sums = []
        for x, spec, shape, mask in zip(blocks, specs, shapes, masks):
            starts = []
            for dim_axes, size in zip(_spec_axes(spec, len(shape)), x.shape):
                index = jnp.int32(0)
                for ax in dim_axes:
                    index = index * mesh.shape[ax] + lax.axis_index(ax)
                starts.append(index * size)
            digest = functools.partial(_leaf_digest, x, starts, shape)
            if mask.all():
                sums.append(digest())
            else:
                sums.append(lax.cond(jnp.asarray(mask)[at], digest, lambda: jnp.zeros(2, jnp.uint32)))
        return jnp.stack(sums)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(tuple(mesh.axis_names)),
                               check_vma=False))
    _digest_fns[key] = fn
    return fn


def _plain_digest_fn():
    if None not in _digest_fns:
        _digest_fns[None] = jax.jit(lambda xs: jnp.stack([_leaf_digest(x) for x in xs]))
    return _digest_fns[None]


def _digests(tree) -> dict[str, _Digest | None]:
    out: dict[str, _Digest | None] = {}
    sharded: dict[Any, list[tuple[str, Any]]] = {}
    other: dict[Any, list[tuple[str, Any]]] = {}
    for name, x in leaf_paths(tree).items():
        if _bits(getattr(x, "dtype", None)) is None:
            out[name] = None
            continue
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and _evenly_sharded(x):
            sharded.setdefault(s.mesh, []).append((name, x))
        else:  # numpy leaves, single-device or uneven shardings: one sum, placed by XLA
            other.setdefault(frozenset(s.device_set) if s is not None else None, []).append((name, x))
    pending = []
    for mesh, members in sharded.items():
        specs, shapes = tuple(x.sharding.spec for _, x in members), tuple(tuple(x.shape) for _, x in members)
        pending.append((mesh, members, specs, shapes, _sharded_digest_fn(mesh, specs, shapes)(*[x for _, x in members])))
    plain = [(members, _plain_digest_fn()([x for _, x in members])) for members in other.values()]
    for mesh, members, specs, shapes, rows in pending:
        if rows.is_fully_addressable:
            rows = np.asarray(rows)
        else:  # a few bytes per device and array: every process sees every device's sums
            from jax.experimental import multihost_utils

            rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
        for i, ((name, _), spec, shape) in enumerate(zip(members, specs, shapes)):
            out[name] = _combine(_block_layout(mesh, spec, shape), rows[:, i])
    for members, sums in plain:
        if not sums.is_fully_addressable:
            sums = sums.addressable_data(0)
        out.update((name, _Digest(_hex(v))) for (name, _), v in zip(members, np.asarray(sums)))
    return out


def array_checksums(tree) -> dict[str, str | None]:
    """``{leaf path: 16 hex digits}``: each array's checksum, the same for any sharding of it.

    Each device reads the shards it holds in place (no copy, nothing gathered), once per host
    for a block several of its devices hold; only 8 bytes per device and array cross hosts.
    Every process must call it (a collective on multi-host arrays). Leaves of a dtype it cannot
    read bitwise (e.g. typed PRNG keys) map to None.
    """
    return {name: None if d is None else d.total for name, d in _digests(tree).items()}


def _extra_digest(extra: dict) -> str:
    return hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()


def _make_record(state, extra: dict) -> dict:
    digests = _digests(state)
    leaves = {}
    for name, x in leaf_paths(state).items():
        d = digests[name]
        leaves[name] = {"shape": list(np.shape(x)), "dtype": str(x.dtype), "checksum": d and d.total}
        if d is not None and d.blocks is not None and len(d.blocks) <= _MAX_BLOCKS:
            leaves[name]["blocks"] = d.blocks
    return {"format": _FORMAT, "leaves": leaves, "extra": _extra_digest(extra)}


def _agree(flag: bool) -> list[int]:
    """Processes whose ``flag`` is set: all processes must take the same branch after a read."""
    if jax.process_count() == 1:
        return [0] if flag else []
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32))).reshape(-1)
    return [int(p) for p in np.flatnonzero(flags)]


def _first_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else (str(e) or repr(e))
    return text.strip().splitlines()[0][:500] if text.strip() else type(e).__name__


# ---- what a failed read means ------------------------------------------------------------------

_READ_ERROR = re.compile(r'\b([A-Z][A-Z_]{3,}): (?:.*?)(?:Error reading|Metadata at) "([^"/]+)/([^"]*)"[^\n]*')


def _what_failed(status: str, message: str, chunk: str) -> str:
    low = message.lower()
    if status == "DATA_LOSS" or "checksum" in low:
        return "checksum mismatch (found by the storage layer)"
    if status == "OUT_OF_RANGE" or "truncated" in low:
        return "truncated"
    if status == "NOT_FOUND":
        return "missing array" if chunk.startswith(".z") or chunk == "zarr.json" else "missing file"
    if "zstd" in low or "decompress" in low:
        return "corrupt data (does not decompress)"
    return "unreadable"


def _file_damage(path: str, end: int, sizes: dict[str, int]) -> str | None:
    if path not in sizes:
        sizes[path] = os.path.getsize(path) if os.path.exists(path) else -1
    if sizes[path] < 0:
        return "missing file"
    return "truncated" if sizes[path] < end else None


def _location(item_dir: str, loc: str) -> tuple[str, int]:
    """The file and end offset of an OCDBT location ``kind:<base>:<file>:<offset>:<length>``."""
    paths, offset, length = loc.split(":", 1)[1].rsplit(":", 2)
    base, rel = paths.split(":", 1)
    return os.path.join(item_dir, base, rel), int(offset) + int(length)


def _scan_files(item_dir: str, names: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Missing or truncated files of an Orbax (OCDBT) item, per array, without reading array data.

    Walks the item's B-tree with TensorStore's ``ocdbt.dump`` (which verifies the index's own
    CRC-32C) and checks that every file a value points into exists and is long enough.

    Args:
        item_dir: e.g. ``<dir>/<step>/state``.
        names: maps Orbax's dotted array names (``params.w1``) to leaf paths (``params/w1``).

    Returns:
        ``[(leaf path, what is wrong), ...]``; ``""`` as the path for damage to the index itself.
    """
    names = names or {}
    if not os.path.exists(os.path.join(item_dir, "manifest.ocdbt")):
        return []
    import tensorstore as ts

    problems: dict[str, str] = {}
    sizes: dict[str, int] = {}
    try:
        base = ts.KvStore.open({"driver": "file", "path": item_dir.rstrip("/") + "/"}).result()
        versions = ts.ocdbt.dump(base).result().get("versions") or []
    except Exception as e:  # noqa: BLE001 - any failure here is damage to the manifest
        return [("", f"its index (manifest.ocdbt) is unreadable: {_first_line(e)}")]
    todo = [(versions[-1]["root"]["location"], b"")] if versions and versions[-1]["root"].get("location") else []
    while todo:
        loc, prefix = todo.pop()
        path, end = _location(item_dir, loc)
        rel = os.path.relpath(path, item_dir)
        damage = _file_damage(path, end, sizes)
        try:
            node = None if damage else ts.ocdbt.dump(base, loc).result()
        except Exception as e:  # noqa: BLE001
            damage = f"unreadable: {_first_line(e)}"
        if damage:
            problems.setdefault("", f"its index (B-tree node in {rel}) is {damage}; no array can be read")
            continue
        for entry in node.get("entries", []):
            if "location" in entry:  # an inner node: its children's keys drop the common prefix
                todo.append((entry["location"], prefix + entry.get("subtree_common_prefix", b"")))
            elif "indirect_value" in entry:
                path, end = _location(item_dir, entry["indirect_value"])
                damage = _file_damage(path, end, sizes)
                if damage:
                    array = (prefix + entry["key"]).split(b"/")[0].decode(errors="replace")
                    problems.setdefault(names.get(array, array), f"{damage} ({os.path.relpath(path, item_dir)})")
    return sorted(problems.items())


def _read_problems(error: BaseException, names: dict[str, str], context: str) -> list[tuple[str, str]]:
    """Why Orbax could not read an item (whose files ``_scan_files`` found whole): the array and
    status TensorStore names in the error chain, else ``context`` and the error."""
    seen, e = [], error
    while e is not None and len(seen) < 20:
        seen.append(e)
        m = _READ_ERROR.search(str(e))
        if m:
            status, array, chunk = m.groups()
            return [(names.get(array, array), f"{_what_failed(status, m.group(0), chunk)} ({m.group(0)[:300]})")]
        e = e.__cause__ or e.__context__
    return [("", f"{context} ({type(error).__name__}: {_first_line(error)})")]


class _KeepIntact:
    """Orbax preservation policy: the ``keep`` newest steps not known to be corrupt, plus every
    step known to be corrupt (evidence is never deleted, and it holds no place in ``keep``)."""

    def __init__(self, keep: int | None, corrupt: set[int]):
        self.keep, self.corrupt = keep, corrupt

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        intact = sorted((c.step for c in checkpoints if c.step not in self.corrupt), reverse=True)
        kept = set(intact if self.keep is None else intact[: self.keep])
        return [c.step in kept or c.step in self.corrupt for c in checkpoints]


def abstract_target(plan: Plan, like, shardings=None):
    """``like`` as a tree of ``jax.ShapeDtypeStruct`` with shardings on ``plan.mesh``.

    Args:
        plan: the plan to restore onto; every sharding must be on its mesh.
        like: a ``TrainState`` (or any pytree) of ``jax.Array`` or ``ShapeDtypeStruct`` leaves,
            e.g. what the new run's ``step.init`` returned.
        shardings: optional tree of ``NamedSharding`` matching ``like`` (e.g.
            ``step.state_shardings(like)``); overrides the leaves' own shardings.

    Raises:
        CheckpointError: a leaf has no sharding, or one on another mesh than the plan's.
    """
    if shardings is not None:
        like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)
    missing, foreign = [], []

    def one(path, x):
        name = "/".join(_key_str(k) for k in path)
        s = getattr(x, "sharding", None)
        if s is None and getattr(x, "ndim", None) == 0:
            s = NamedSharding(plan.mesh, P())  # a bare scalar: replicate it, nothing to choose
        if s is None or not hasattr(x, "shape"):
            missing.append(f"  {name}: {type(x).__name__} {_describe(x)}")
            return None
        if not isinstance(s, NamedSharding) or s.mesh != plan.mesh:
            where = f"mesh {dict(s.mesh.shape)}" if isinstance(s, NamedSharding) else type(s).__name__
            foreign.append(f"  {name}: on {where}")
            return None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    target = jax.tree_util.tree_map_with_path(one, like)
    if missing:
        raise CheckpointError(
            "restore(like=...) needs a sharding for every leaf; these have none:\n" + "\n".join(missing) +
            "\nPass the TrainState from the new run's step.init(...), or shardings=step.state_shardings(like).")
    if foreign:
        raise CheckpointError(
            f"restore(plan, like=...): these leaves of `like` are not on the plan's mesh {dict(plan.mesh.shape)}:\n"
            + "\n".join(foreign) + "\nCreate `like` with a train step built on this plan (step.init), "
            "or pass shardings=step.state_shardings(like).")
    return target


class Checkpointer:
    """Saves and restores ``TrainState`` checkpoints with Orbax (multi-host, async, any mesh).

    Every process must call ``save``/``restore``/``wait`` (they are collective); the directory
    must be visible to all hosts (a shared filesystem or a bucket Orbax supports).

    Attributes:
        directory: the absolute checkpoint directory (one subdirectory per step).
        keep: how many complete checkpoints to keep (None: all). The newest complete one is
            never deleted: old steps go only after a new save has committed. Steps a restore
            found corrupt are never deleted and do not count (so they cannot push the last
            intact step out).
        every: ``save`` writes only when ``step % every == 0`` (None: every call); ``force=True``
            overrides (preemption and final saves).
        async_save: write in a background thread; ``save`` returns once the arrays are copied
            off the devices, so the state may be donated to the next step right away.
        checksums: record a checksum per array with every save (restores verify them whenever
            present, whatever this is set to).
        last_restore: a ``RestoreInfo`` (step, verified, corrupt steps skipped) for the last
            ``restore``/``resume``, or None.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, every: int | None = None,
                 async_save: bool = True, checksums: bool = True):
        for name, v in (("keep", keep), ("every", every)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Checkpointer({name}={v!r}): use a positive integer, or None")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep, self.every, self.async_save = keep, every, bool(async_save)
        self.checksums = bool(checksums)
        self.last_restore: RestoreInfo | None = None
        self._corrupt: set[int] = set()  # steps a restore found damaged: kept, never counted in `keep`
        self._mngr: ocp.CheckpointManager | None = None
        self._writer = False

    # ---- the Orbax manager -----------------------------------------------------------------

    def _manager(self, create: bool) -> ocp.CheckpointManager | None:
        """The manager, made on first use; ``None`` if the directory is absent and not ``create``.

        Interrupted saves are removed only by a writer (``create``): a reader (an evaluation job
        following a live run) must not delete the temporary directory of a save in progress.
        """
        if self._mngr is not None and (not create or self._writer):
            return self._mngr
        if not os.path.isdir(self.directory):
            if not create:
                return None
            if os.path.exists(self.directory):
                raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a directory")
        if self._mngr is not None:
            self._mngr.close()
        partial = self._partial_saves() if create else []
        if partial and jax.process_index() == 0:
            log.warning("removing %d interrupted save(s) in %s: %s", len(partial), self.directory, ", ".join(partial))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_KeepIntact(self.keep, self._corrupt), create=create,
            cleanup_tmp_directories=create, enable_async_checkpointing=self.async_save)
        handlers = {"state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler(),
                    _RECORD: ocp.JsonCheckpointHandler()}
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._writer = create
        return self._mngr

    def _reader(self) -> ocp.CheckpointManager | None:
        """The manager with a fresh view of the directory (another job may be writing to it)."""
        m = self._manager(create=False)
        if m is not None and not self._writer:
            m.reload()
        return m

    def _partial_saves(self) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(n for n in os.listdir(self.directory) if _TMP_MARK in n)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (no directory or no complete save)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, oldest first (interrupted saves are not listed;
        complete steps a restore found corrupt are, since they are still on disk)."""
        m = self._reader()
        return [] if m is None else sorted(m.all_steps())

    def wait(self) -> None:
        """Blocks until every pending async save has committed (call before exiting)."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()
            self._mngr.close()
            self._mngr = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- save ------------------------------------------------------------------------------

    def save(self, state, step: int | None = None, extra: dict | None = None, *, force: bool = False,
             allow_nonfinite: bool = False) -> bool:
        """Saves ``state`` (and ``extra``) as checkpoint ``step``; every process must call it.

        Args:
            state: a ``TrainState`` (or any pytree of arrays). Each host writes only the shards
                it holds; with ``async_save`` it may be donated to the next step as soon as this
                returns.
            step: the checkpoint's step (default: ``int(state.step)``, which waits for the step
                that produced ``state``; pass it to keep the host running ahead).
            extra: a JSON-serialisable dict stored beside the state (data position, config).
            force: save even if ``step`` is not a multiple of ``every``.
            allow_nonfinite: write even if a float leaf holds NaN/inf (refused by default so a
                diverged run never replaces a good checkpoint).

        Returns:
            True if a checkpoint was written (started, if async); False if ``every`` skips this
            step or ``step`` is already saved (an existing checkpoint is never overwritten, a
            corrupt one included: a warning says so).

        Raises:
            CheckpointError: non-finite values (each leaf named), or ``extra`` is not JSON.
        """
        if step is None:
            if not hasattr(state, "step"):
                raise ValueError("save(state) without step= needs a state with a .step (an sk.TrainState)")
            step = int(jax.device_get(state.step))
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
        step = int(step)
        if not force and self.every is not None and step % self.every:
            return False
        extra = {} if extra is None else extra
        try:
            extra = json.loads(json.dumps(extra))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"save(extra=...) must be JSON-serialisable (dicts, lists, str, numbers): {e}") from None
        mngr = self._manager(create=True)
        if step in mngr.all_steps():
            if step in self._corrupt:
                log.warning("not saving step %d: %s holds a corrupt checkpoint of that step, kept for inspection "
                            "(never overwritten); move it away to save this step", step,
                            os.path.join(self.directory, str(step)))
            return False
        if not allow_nonfinite:
            bad = nonfinite_leaves(state)
            if bad:
                latest = self.latest_step()
                keep_txt = (f"checkpoint step {latest} is left as it was" if latest is not None
                            else "nothing was written")
                raise CheckpointError(
                    f"refusing to save step {step}: non-finite values (NaN/inf) in\n  " + "\n  ".join(bad) +
                    f"\n{keep_txt}. Restore it and lower the learning rate / enable clip_norm or "
                    "skip_nonfinite, or pass allow_nonfinite=True to save anyway (e.g. to debug).")
        items = {"state": ocp.args.StandardSave(state), "extra": ocp.args.JsonSave(extra)}
        if self.checksums:
            items[_RECORD] = ocp.args.JsonSave(_make_record(state, extra))
        meta = _describe_layout(state)
        meta["shardkit"]["checksums"] = self.checksums
        saved = mngr.save(step, args=ocp.args.Composite(**items), force=True, custom_metadata=meta)
        if not self.async_save:
            mngr.wait_until_finished()
        return bool(saved)

    # ---- restore ---------------------------------------------------------------------------

    def _require_step(self, step: int | None) -> tuple[ocp.CheckpointManager, int]:
        mngr = self._reader()
        if mngr is None:
            raise CheckpointError(
                f"no checkpoint directory {self.directory}: check the path (and that every host "
                "sees it), or start without resuming")
        if self._writer:
            mngr.wait_until_finished()  # never read a step that is still being written
        steps = sorted(mngr.all_steps())
        if not steps:
            partial = self._partial_saves()
            why = f" (only interrupted saves: {', '.join(partial)})" if partial else ""
            raise CheckpointError(f"no complete checkpoint in {self.directory}{why}; start without resuming")
        if step is None:
            return mngr, steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; complete steps: {steps}")
        return mngr, int(step)

    def restore(self, plan: Plan, like, step: int | None = None, *, shardings=None, fallback: bool = False):
        """Restores checkpoint ``step`` (default: the latest) onto ``plan``, verified.

        The layout comes only from ``like``/``plan``, never from the checkpoint, so any saved mesh
        and ZeRO stage restore onto any new one (each device reads just its slice). Dtypes follow
        ``like`` (values are cast if the precision changed, after verification). Every array is
        checked against the checksum saved with it before anything is returned; a checkpoint
        written without checksums restores unverified, with a logged warning.

        Args:
            plan: the plan of the run being resumed; ``like``'s shardings must be on its mesh.
            like: a ``TrainState`` made on ``plan`` (the new run's ``step.init(...)``) or an
                abstract one (``ShapeDtypeStruct`` leaves with shardings).
            step: which checkpoint (default: the newest complete one).
            shardings: optional ``NamedSharding`` tree (``step.state_shardings(like)``) used
                instead of ``like``'s own.
            fallback: if ``step`` is corrupt, log a warning and try the next older step, and so
                on, until one is intact. Damaged steps are left as they are on disk.
                ``self.last_restore`` tells which step came back and which were skipped.

        Returns:
            The restored state, with ``like``'s tree structure and shardings.

        Raises:
            CorruptCheckpointError: the step is damaged (each array and what is wrong listed).
            CheckpointError: with ``fallback``, no step is intact (every step's problems listed);
                no such directory or step, the checkpoint's tree/shapes do not match ``like``
                (every differing leaf listed), or ``like`` is not on ``plan.mesh``.
        """
        if not isinstance(plan, Plan):
            raise ValueError(f"restore(plan, ...) needs an sk.Plan, got {type(plan).__name__}")
        target = abstract_target(plan, like, shardings)
        mngr, step = self._require_step(step)
        return self._first_intact(mngr, step, target, fallback, with_extra=False)[0]

    def resume(self, plan: Plan, like, *, shardings=None, fallback: bool = False) -> tuple[Any, dict | None]:
        """The newest checkpoint restored onto ``plan`` and its ``extra``, read from the same
        step; ``(like, None)`` when the directory holds none yet (a first run).

        With ``fallback=True`` a corrupt newest step is skipped (warning logged) for the newest
        intact one, whose state *and* extra are returned; ``self.last_restore.step`` is that step.

        Raises:
            CheckpointError: as ``restore``.
        """
        if self.latest_step() is None:
            return like, None
        if not isinstance(plan, Plan):
            raise ValueError(f"resume(plan, ...) needs an sk.Plan, got {type(plan).__name__}")
        target = abstract_target(plan, like, shardings)
        mngr, step = self._require_step(None)
        return self._first_intact(mngr, step, target, fallback, with_extra=True)

    def extra(self, step: int | None = None) -> dict:
        """The ``extra`` dict saved with checkpoint ``step`` (default: the latest), verified
        against its checksum when the step has one.

        Raises:
            CorruptCheckpointError: it is unreadable or differs from what was saved.
        """
        mngr, step = self._require_step(step)
        return self._read_extra(mngr, step, self._read_record(mngr, step))

    def _first_intact(self, mngr, step: int, target, fallback: bool, with_extra: bool):
        candidates = [step] + ([s for s in sorted(mngr.all_steps(), reverse=True) if s < step] if fallback else [])
        skipped: list[CorruptCheckpointError] = []
        for s in candidates:
            try:
                state, extra, verified = self._load(mngr, s, target, with_extra)
            except CorruptCheckpointError as e:
                self._corrupt.add(s)
                if not fallback:
                    raise
                log.warning("%s\nfalling back to an older step.", e)
                skipped.append(e)
                continue
            self.last_restore = RestoreInfo(s, verified, tuple((e.step, e.problems) for e in skipped))
            if skipped:
                log.warning("restored checkpoint step %d of %s; corrupt newer step(s) %s skipped and left untouched",
                            s, self.directory, [e.step for e in skipped])
            return state, extra
        raise CheckpointError(
            f"no intact checkpoint in {self.directory}: every complete step is corrupt "
            f"(each is left as it is on disk):\n" + "\n".join(
                f"  step {e.step}: " + "; ".join(f"{leaf or '(the whole step)'}: {what}" for leaf, what in e.problems)
                for e in skipped) + "\nStart without resuming, or point --checkpoint-dir elsewhere.")

    def _damaged(self, step: int, problems: list[tuple[str, str]]) -> CorruptCheckpointError:
        steps = self._mngr.all_steps() if self._mngr is not None else []
        return CorruptCheckpointError(self.directory, step, problems, sorted(steps))

    def _read_record(self, mngr, step: int) -> dict | None:
        """The step's checksum record; None for a step saved without one (it says which)."""
        step_dir = os.path.join(self.directory, str(step))
        try:
            meta = (mngr.metadata(step).custom_metadata or {}).get("shardkit", {})
        except Exception:  # noqa: BLE001 - unreadable step metadata: the item itself decides
            meta = {}
        if not os.path.isdir(os.path.join(step_dir, _RECORD)):
            if meta.get("checksums"):
                raise self._damaged(step, [("", f"missing file: its checksum record ({_RECORD}/) is gone")])
            return None
        try:
            record = mngr.restore(step, args=ocp.args.Composite(**{_RECORD: ocp.args.JsonRestore()}))[_RECORD]
        except Exception as e:  # noqa: BLE001 - any Orbax/JSON failure: the record is damaged
            raise self._damaged(step, [("", f"its checksum record is unreadable ({_first_line(e)})")]) from e
        if not (isinstance(record, dict) and record.get("format") == _FORMAT and isinstance(record.get("leaves"), dict)):
            raise self._damaged(step, [("", f"its checksum record is not a {_FORMAT} record")])
        return record

    def _read_extra(self, mngr, step: int, record: dict | None) -> dict:
        try:
            out = mngr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise self._damaged(step, [("extra", f"unreadable ({_first_line(e)})")]) from e
        extra = dict(out.extra or {})
        if record is not None and record.get("extra") not in (None, _extra_digest(extra)):
            raise self._damaged(step, [("extra", "checksum mismatch")])
        return extra

    def _load(self, mngr, step: int, target, with_extra: bool) -> tuple[Any, dict | None, bool]:
        """Reads one step into ``target`` and verifies it; CorruptCheckpointError if damaged."""
        record = self._read_record(mngr, step)
        expected = leaf_paths(target)
        names = {name.replace("/", "."): name for name in expected}
        # Missing or short files (and a damaged index) are found from the index alone, before
        # Orbax reads anything through it.
        item = os.path.join(self.directory, str(step), "state")
        try:
            problems = _scan_files(item, names)
        except Exception as e:  # noqa: BLE001 - the scan is a diagnosis; the reads below decide
            log.info("could not scan %s for damaged files: %s", item, e)
            problems = []
        failed = _agree(bool(problems))
        if failed:
            raise self._damaged(step, problems or [("", f"process(es) {failed} found damaged files (see their error)")])
        try:
            saved = mngr.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any Orbax/tensorstore failure means unreadable
            raise self._damaged(step, _read_problems(e, names, "its state metadata is unreadable")) from e
        if saved is None:
            raise self._damaged(step, [("", "missing file: its state item has no metadata")])
        saved = leaf_paths(getattr(saved, "tree", saved))
        if record is not None:
            lost = _record_vs_metadata(record["leaves"], saved)
            if lost:
                raise self._damaged(step, lost)
        diff = tree_mismatches(saved, expected)
        if diff:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match the model being restored "
                f"({len(diff)} leaves differ):\n" + "\n".join(diff) +
                "\nRestore with the model/optimizer config it was saved with, or start a new directory.")
        read = target if record is None else _in_saved_dtypes(target, record["leaves"])
        error = None
        try:
            state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(read))).state
        except Exception as e:  # noqa: BLE001 - diagnosed below
            error = e
        failed = _agree(error is not None)
        if failed:
            problems = (_read_problems(error, names, "unreadable") if error is not None
                        else [("", f"process(es) {failed} could not read it (see their error)")])
            raise self._damaged(step, problems) from error
        if record is None:
            log.warning("checkpoint step %d in %s has no checksums (saved before shardkit wrote them, or with "
                        "checksums=False): restored unverified", step, self.directory)
        else:
            problems = _verify(state, record["leaves"])
            failed = _agree(bool(problems))
            if failed and not problems:
                problems = [("", f"process(es) {failed} read arrays that differ from their checksums (see their error)")]
            if problems:
                raise self._damaged(step, problems)
            state = jax.tree.map(_cast_to, state, target)
        extra = self._read_extra(mngr, step, record) if with_extra else None
        return state, extra, record is not None


def _record_vs_metadata(record: dict, saved: dict) -> list[tuple[str, str]]:
    """Arrays the checksum record lists (= what was saved) that the state's metadata lacks or
    shapes differently, and the reverse: damage to the metadata, not another model."""
    out = []
    for name in sorted(set(record) | set(saved)):
        if name not in saved:
            out.append((name, f"missing array: saved as {tuple(record[name]['shape'])} {record[name]['dtype']}, "
                              "absent from the step's state metadata"))
        elif name not in record:
            out.append((name, "not in the step's checksum record (the record or the metadata is damaged)"))
        elif tuple(record[name]["shape"]) != tuple(saved[name].shape):
            out.append((name, f"metadata says shape {tuple(saved[name].shape)}, saved as {tuple(record[name]['shape'])}"))
    return out


def _in_saved_dtypes(target, record: dict):
    """``target`` with each checksummed leaf in the dtype it was saved in: the checksum covers
    those bits, so a cast (a new precision) happens only after verification."""
    def one(path, t):
        entry = record.get("/".join(_key_str(k) for k in path))
        if entry is None or entry["checksum"] is None or entry["dtype"] == str(t.dtype):
            return t
        return jax.ShapeDtypeStruct(t.shape, jnp.dtype(entry["dtype"]), sharding=t.sharding)
    return jax.tree_util.tree_map_with_path(one, target)


def _cast_to(x, t):
    if x.dtype == t.dtype:
        return x
    return jax.jit(lambda a: a.astype(t.dtype), out_shardings=t.sharding)(x)


def _verify(state, record: dict) -> list[tuple[str, str]]:
    """``[(leaf, what)]`` for every restored array that differs from its checksum, naming the
    blocks that differ when the restore reads the blocks the save wrote, and for every block
    a host read differently from the others."""
    problems, unverified = [], []
    for name, got in _digests(state).items():
        entry = record[name]
        if entry["checksum"] is None or got is None:
            unverified.append(name)
            continue
        if got.total != entry["checksum"]:
            saved = entry.get("blocks") or {}
            bad = [b for b, v in (got.blocks or {}).items() if b in saved and saved[b] != v]
            where = f" in block{'s' if len(bad) > 1 else ''} " + ", ".join(f"[{b}]" for b in bad) if bad else ""
            problems.append((name, f"checksum mismatch{where} (saved {entry['checksum']}, read {got.total})"))
        if got.disagreements:
            problems.append((name, "checksum mismatch: " + "; ".join(got.disagreements) + " differs from the first copy"))
    if unverified:
        log.info("no checksum for %s (dtypes without a bitwise view): restored unverified", ", ".join(unverified))
    return problems


def _describe_layout(state) -> dict:
    """Informational metadata: the mesh the state was saved from (restores never use it)."""
    for x in jax.tree.leaves(state):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return {"shardkit": {"mesh": {k: int(v) for k, v in s.mesh.shape.items()},
                                 "process_count": jax.process_count()}}
    return {"shardkit": {"process_count": jax.process_count()}}


class PreemptionGuard:
    """Turns a preemption notice (SIGTERM) into "stop at the next step boundary".

    On one process it installs a handler for ``signals`` that only sets a flag (the current
    step finishes normally). On several processes the notice may reach one host only, so it
    asks JAX's preemption sync manager instead (``reached_preemption_sync_point``), which
    agrees on the same step on every host; JAX installs its own SIGTERM notifier there.

    Call ``should_stop(step)`` once per step on every process, then save (``force=True``) and
    exit 0. Usable as a context manager; ``close()`` restores the previous handlers.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)):
        self._event = threading.Event()
        self._old: dict[int, Any] = {}
        self.multiprocess = jax.process_count() > 1
        if self.multiprocess:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be created in the main thread (Python delivers signals there)")
        for sig in signals:
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self._event.set()
        log.warning("received signal %d: will checkpoint and stop at the next step boundary", signum)
        # A second signal takes the default action (e.g. terminate) if saving hangs.
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    @property
    def requested(self) -> bool:
        """True once a preemption signal reached this process."""
        return self._event.is_set()

    def request(self) -> None:
        """Asks to stop at the next boundary, as a signal would (single-process runs only)."""
        self._event.set()

    def should_stop(self, step: int) -> bool:
        """True when the run should save and exit after ``step`` (call it every step, all hosts)."""
        if self.multiprocess:
            from jax.experimental import multihost_utils

            # Never mix in this host's own flag: hosts must agree on the step or they deadlock.
            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return self._event.is_set()

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Checkpointer", "CheckpointError", "CorruptCheckpointError", "PreemptionGuard", "RestoreInfo",
           "abstract_target", "array_checksums", "leaf_paths", "nonfinite_leaves", "tree_mismatches"]
