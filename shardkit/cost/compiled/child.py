"""The compiling subprocess of ``simulate``: ``python -m shardkit.cost.compiled.child DIR N``.

It receives serialized modules (``jax.export``) and their requests in ``DIR``, makes the
target's devices (N simulated CPU devices, or a GPU/TPU target's compile-only devices, under
``JAX_PLATFORMS=cpu``), compiles each module with the step's donation, and writes a small JSON
summary per module (memory, collectives through loops, matmul flops; never the HLO itself). A
module that fails to compile gets ``{"error": ...}``, so one layout that does not fit does not
lose the others. The user's process keeps its own backend.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import jax

from .executable import report_from_compiled
from .report import shard_bytes
from . import targets as targets_lib


class SimulationError(RuntimeError):
    """The subprocess that compiles for the simulated mesh failed (its stderr is in the message)."""


class DoesNotFit(SimulationError):
    """The target's compiler refused the program for want of device memory (XLA:TPU does so
    at compile time). ``required`` and ``available``: the bytes per device it reported."""

    def __init__(self, message: str, required: float, available: float):
        super().__init__(message)
        self.required, self.available = required, available


_OOM = re.compile(r"total memory required for HLO temporaries \(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)")


def compile_error(out: dict) -> Exception:
    """The exception for a job the child could not compile: ``TargetError`` for a mesh the
    target has no devices for, ``DoesNotFit`` for a compiler's out-of-memory verdict, else
    ``SimulationError`` with the child's message."""
    if out.get("target_error"):
        return targets_lib.TargetError(out["error"])
    m = _OOM.search(out["error"])
    if m is None:
        return SimulationError(out["error"])
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    need, have = float(m.group(1)) * scale[m.group(2)], float(m.group(3)) * scale[m.group(4)]
    return DoesNotFit(f"does not fit: the compiler needs {need / 2**30:.1f} GiB of temporaries per device, "
                      f"the device has {have / 2**30:.1f} GiB ({out['error'].splitlines()[0][:300]})", need, have)


_KERNELS: list[str] = []  # this process's directory of XLA:GPU kernel caches, made on first use


def _kernel_cache(target: str) -> str:
    """The XLA:GPU kernel cache file (``xla_gpu_kernel_cache_file``) this process's compiles
    for ``target`` share: layouts of one model, and the steps one session simulates, share
    kernels, and a kernel found there skips its LLVM and ptxas compile (the test suite's six
    recipe layouts for H100 in one child: 93 -> 76 CPU s). Only machine code is cached: the
    HLO, the buffer assignment and so every figure of the report are the compiler's own. One
    file per target (its GPU architecture) and per thread (one child at a time writes it);
    removed at exit."""
    if not _KERNELS:
        _KERNELS.append(tempfile.mkdtemp(prefix="shardkit-kernels-"))
        atexit.register(shutil.rmtree, _KERNELS[0], ignore_errors=True)
    return os.path.join(_KERNELS[0], f"{target}-{threading.get_ident()}.bin")


def run_child(modules: list[bytes], requests: list[dict], *, timeout: float) -> list[dict]:
    """Runs ``python -m shardkit.cost.compiled.child`` on serialized modules (one target for all) and
    returns one JSON summary per module (``{"error": ...}`` for one that failed to compile)."""
    n = max(math.prod(s for _, s in r["mesh"]) for r in requests)
    target = requests[0].get("target", "cpu")
    cpu = target == "cpu"
    kernels = _kernel_cache(target) if targets_lib.get(target).platform == "cuda" else ""
    # JAX runs on CPU in the child either way: a GPU/TPU target's devices are compile-only
    # descriptions from its plugin (and the CUDA plugin's driver check is skipped on CPU).
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n if cpu else 1))
    if targets_lib.get(target).platform == "tpu":
        # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) meant for processes that drive
        # TPU chips; a compile-only client drives none, so two compiles (two notebooks, two
        # pytest workers) may hold it at once.
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # The child imports this very shardkit, installed or not (e.g. a script's sys.path insert).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    # The parent's device-count flag would fight the child's.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    what = (f"the mesh {requests[0]['mesh']}" if len(requests) == 1
            else f"{len(requests)} meshes") + f" ({target})"
    with tempfile.TemporaryDirectory(prefix="shardkit-sim-") as tmp:
        for i, (module, request) in enumerate(zip(modules, requests)):
            with open(os.path.join(tmp, f"module{i}.bin"), "wb") as f:
                f.write(module)
            with open(os.path.join(tmp, f"request{i}.json"), "w") as f:
                json.dump(request, f)
        cmd = [sys.executable, "-m", "shardkit.cost.compiled.child", tmp, str(len(requests)), kernels]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            _drop(kernels)  # a child killed while writing it may leave it cut short
            raise SimulationError(f"compiling for {what} took more than {timeout:.0f} s (timeout=); "
                                  f"stderr tail:\n{_tail(e.stderr)}") from None
        if proc.returncode != 0:
            _drop(kernels)
            raise SimulationError(f"compiling for {what} failed (exit {proc.returncode}); stderr "
                                  f"tail:\n{_tail(proc.stderr)}")
        outs = []
        for i in range(len(requests)):
            with open(os.path.join(tmp, f"report{i}.json")) as f:
                outs.append(json.load(f))
        return outs


def _drop(path: str) -> None:
    if path and os.path.exists(path):
        os.remove(path)


def _tail(text, n: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def _child(directory: str, count: int, kernels: str = "") -> None:
    """The subprocess: for each module, deserialize, compile with donation on the target's
    devices, summarise; a module that fails to compile gets ``{"error": ...}``. ``kernels``: an
    XLA:GPU kernel cache file to read and extend (``_kernel_cache``), or empty."""
    requests = []
    for i in range(count):
        with open(os.path.join(directory, f"request{i}.json")) as f:
            requests.append(json.load(f))
    target = targets_lib.get(requests[0].get("target", "cpu"))
    if target.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", max(math.prod(s for _, s in r["mesh"]) for r in requests))
    for i, req in enumerate(requests):
        try:
            out = _compile_one(os.path.join(directory, f"module{i}.bin"), req, target, kernels)
        except targets_lib.TargetError as err:  # the user's input: their error, without our traceback
            out = {"error": str(err), "target_error": True}
        except Exception as err:  # noqa: BLE001 — reported for this module; the others go on
            import traceback

            out = {"error": f"compiling for the mesh {req['mesh']} ({target.name}) failed: "
                            f"{type(err).__name__}: {_tail(str(err))}\n{_tail(traceback.format_exc(), 2000)}"}
        with open(os.path.join(directory, f"report{i}.json"), "w") as f:
            json.dump(out, f)


def _compile_one(path: str, req: dict, target: targets_lib.Target, kernels: str = "") -> dict:
    t0 = time.perf_counter()
    pairs = [tuple(p) for p in req["mesh"]]
    n = math.prod(s for _, s in pairs)
    layout: list[str] = []
    if target.platform == "cpu":
        from ...mesh import make_mesh

        mesh = make_mesh(pairs, devices=jax.devices()[:n])
    else:
        mesh, layout = targets_lib.device_mesh(target, pairs)
    with open(path, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    (args_sh, _) = exported.in_tree.unflatten(exported.in_shardings_jax(mesh))
    out_sh = exported.out_tree.unflatten(exported.out_shardings_jax(mesh))
    (args, _) = exported.in_tree.unflatten(exported.in_avals)
    if req.get("memory_kinds"):  # offloaded state: the step's own memory kinds, in and out
        kinds = req["memory_kinds"]
        args_sh = ([s.with_memory_kind(k) if k else s for s, k in zip(args_sh[0], kinds)], args_sh[1])
        out_sh = ([s.with_memory_kind(k) if k else s for s, k in zip(out_sh[0], kinds)], out_sh[1])
    t1 = time.perf_counter()
    compiled = jax.jit(exported.call, in_shardings=args_sh, out_shardings=out_sh,
                       donate_argnums=(0,) if req["donate"] else ()).lower(*args).compile(
        {**({"xla_gpu_kernel_cache_file": kernels} if kernels else {}), **req.get("compiler_options", {})} or None)
    t_compile = time.perf_counter() - t1
    (state_sh, batch_sh), _ = compiled.input_shardings
    placed = lambda avals, shs: [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
                                 for a, s in zip(avals, shs)]
    state, batch = placed(args[0], state_sh), placed(args[1], batch_sh)
    memory = {k: shard_bytes([state[i] for i in idx]) for k, idx in req["groups"].items()}
    memory["batch"] = shard_bytes(batch)
    report = report_from_compiled(compiled, req["title"], memory, mesh, tuple(req["data_axes"]),
                                  pipeline=req["pipeline"])
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    out = {"title": report.title, "memory": report.memory, "flops": report.flops,
           "optimal_seconds": float(cost.get("optimal_seconds", 0.0)), "layout": layout,
           "matmul_flops": report.matmul_flops, "fp8_matmul_flops": report.fp8_matmul_flops,
           "unread_matmuls": report.unread_matmuls, "kernels": report.kernels,
           "collectives": [dataclasses.asdict(c) for c in report.collectives],
           "traffic": [dataclasses.asdict(t) for t in report.traffic],
           "branch_collectives": [dataclasses.asdict(c) for c in report.branch_collectives],
           "seconds": {"compile": t_compile, "total": time.perf_counter() - t0}}
    return out


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
