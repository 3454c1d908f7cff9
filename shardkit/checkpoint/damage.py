"""What a failed read means: missing or truncated files found from an Orbax (OCDBT) item's index
alone, and the array and status named in a read error."""

from __future__ import annotations

import os
import re

from .errors import first_line

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


def scan_files(item_dir: str, names: dict[str, str] | None = None) -> list[tuple[str, str]]:
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
        return [("", f"its index (manifest.ocdbt) is unreadable: {first_line(e)}")]
    todo = [(versions[-1]["root"]["location"], b"")] if versions and versions[-1]["root"].get("location") else []
    while todo:
        loc, prefix = todo.pop()
        path, end = _location(item_dir, loc)
        rel = os.path.relpath(path, item_dir)
        damage = _file_damage(path, end, sizes)
        try:
            node = None if damage else ts.ocdbt.dump(base, loc).result()
        except Exception as e:  # noqa: BLE001
            damage = f"unreadable: {first_line(e)}"
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


def read_problems(error: BaseException, names: dict[str, str], context: str) -> list[tuple[str, str]]:
    """Why Orbax could not read an item (whose files ``scan_files`` found whole): the array and
    status TensorStore names in the error chain, else ``context`` and the error."""
    seen, e = [], error
    while e is not None and len(seen) < 20:
        seen.append(e)
        m = _READ_ERROR.search(str(e))
        if m:
            status, array, chunk = m.groups()
            return [(names.get(array, array), f"{_what_failed(status, m.group(0), chunk)} ({m.group(0)[:300]})")]
        e = e.__cause__ or e.__context__
    return [("", f"{context} ({type(error).__name__}: {first_line(error)})")]
