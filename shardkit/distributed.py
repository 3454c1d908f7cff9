"""Multi-host runs: start JAX's multi-controller runtime, feed host-local batches, launch locally.

Every host runs the same program (SPMD). ``initialize()`` connects the processes through JAX's
coordination service (``jax.distributed.initialize``), with its address, process count and id
given explicitly or found in the environment (``JAX_*`` variables, SLURM, Kubernetes JobSet /
indexed Jobs), and with bounded timeouts: a peer that never shows up fails the start, and a peer
that dies mid-run (missed heartbeats, or the coordinator's socket closing) makes JAX terminate
the survivors with a message naming the lost task, instead of hanging in a collective.

``shardkit launch --processes 2 --devices-per-process 4 -- CMD...`` runs such a job on one
machine over loopback for trying multi-host code without a cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from ._quiet import without_chatter

log = logging.getLogger("shardkit.distributed")

DEFAULT_PORT = 8476


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """How this process joins a multi-process job.

    Attributes:
        coordinator_address: ``host:port`` of process 0's coordination service.
        num_processes: how many processes (usually one per host) the job has.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        local_device_ids: the accelerators this process drives (None: all it sees).
        source: where the values came from (for messages): "arguments", "JAX_* variables",
            "SLURM" or "Kubernetes".
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    source: str = "arguments"


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise ValueError(f"{source} environment detected but {name} is not set; set it, or pass the value to "
                         "sk.distributed.initialize(...) explicitly") from None
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[003-007,010],cpu1"`` → ``"gpu003"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.groups()
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "")


def detect(env: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """Reads the job layout from the environment, or returns None (a single-process run).

    Checked in order:
      * ``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (what
        ``shardkit launch`` sets; also ``JAX_LOCAL_DEVICE_IDS``, comma-separated);
      * SLURM (``srun``): ``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_PROCID`` and
        ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``; the coordinator is the first node, on
        ``SHARDKIT_COORDINATOR_PORT`` or a port derived from the job id;
      * Kubernetes: ``JOB_COMPLETION_INDEX`` (indexed Job / JobSet) with ``JAX_NUM_PROCESSES``;
        the coordinator is ``JAX_COORDINATOR_HOST`` if set, else JobSet's pod 0
        (``{JOBSET_NAME}-{REPLICATED_JOB_NAME}-0-0.{JOBSET_NAME}``).

    Raises:
        ValueError: an environment is recognised but a variable is missing or malformed.
    """
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS"):
        src = "JAX_* variables"
        ids = env.get("JAX_LOCAL_DEVICE_IDS")
        return ClusterSpec(env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES", src),
                           _int(env, "JAX_PROCESS_ID", src),
                           tuple(int(i) for i in ids.split(",")) if ids else None, src)
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ValueError("SLURM environment detected but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST; "
                             "run the job with srun")
        port = env.get("SHARDKIT_COORDINATOR_PORT") or str(61440 + _int(env, "SLURM_JOB_ID", "SLURM") % 4096)
        return ClusterSpec(f"{first_slurm_host(nodes)}:{port}", _int(env, "SLURM_NTASKS", "SLURM"),
                           _int(env, "SLURM_PROCID", "SLURM"), None, "SLURM")
    if "JOB_COMPLETION_INDEX" in env:
        host = env.get("JAX_COORDINATOR_HOST")
        if not host:
            if not (env.get("JOBSET_NAME") and env.get("REPLICATED_JOB_NAME")):
                raise ValueError("Kubernetes indexed Job detected (JOB_COMPLETION_INDEX) but no coordinator: set "
                                 "JAX_COORDINATOR_HOST to pod 0's DNS name, or run under a JobSet")
            js = env["JOBSET_NAME"]
            host = f"{js}-{env['REPLICATED_JOB_NAME']}-0-0.{js}"
        port = env.get("JAX_COORDINATOR_PORT", str(DEFAULT_PORT))
        return ClusterSpec(f"{host}:{port}", _int(env, "JAX_NUM_PROCESSES", "Kubernetes"),
                           _int(env, "JOB_COMPLETION_INDEX", "Kubernetes"), None, "Kubernetes")
    return None


def _resolve_spec(coordinator_address, num_processes, process_id, local_device_ids, env) -> ClusterSpec | None:
    """The job ``initialize`` joins: the three values given, all detected from the environment,
    or the given ones completing a detected spec; None for a single-process run."""
    given = (coordinator_address, num_processes, process_id)
    if all(v is None for v in given):
        spec = detect(env)
        if spec is None:
            return None
    elif any(v is None for v in given):
        found = detect(env)
        if found is None:
            raise ValueError("initialize() needs coordinator_address, num_processes and process_id together "
                             "(or none of them, to detect them from JAX_*/SLURM/Kubernetes variables)")
        spec = ClusterSpec(coordinator_address or found.coordinator_address,
                           found.num_processes if num_processes is None else num_processes,
                           found.process_id if process_id is None else process_id,
                           found.local_device_ids, f"arguments + {found.source}")
    else:
        spec = ClusterSpec(coordinator_address, num_processes, process_id, None)
    if local_device_ids is not None:
        spec = dataclasses.replace(spec, local_device_ids=tuple(local_device_ids))
    return spec


def _check_spec(spec: ClusterSpec, timeouts: dict) -> None:
    """Refuses a process index outside the job, a timeout that is not whole seconds >= 1 and
    an address without a port."""
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(f"process_id={spec.process_id} is not in [0, num_processes={spec.num_processes}) "
                         f"(from {spec.source})")
    bad = [f"{k}={v!r}" for k, v in timeouts.items() if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1]
    if bad:  # JAX takes whole seconds; 0 would not bound anything
        raise ValueError(f"{', '.join(bad)}: timeouts are whole seconds >= 1 (e.g. heartbeat_timeout_s=60)")
    if ":" not in spec.coordinator_address:
        raise ValueError(f"coordinator_address {spec.coordinator_address!r} needs a port: 'host:port'")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               timeout_s: int = 300, heartbeat_timeout_s: int = 60, shutdown_timeout_s: int = 60,
               env: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """Joins this process to a multi-process job (call first, before any JAX computation).

    With no arguments and no recognised environment it does nothing and returns None, so
    scripts can call it unconditionally and still run as one process.

    Args:
        coordinator_address: ``host:port`` of process 0 (it binds there; others connect).
        num_processes: the job's process count.
        process_id: this process's index.
        local_device_ids: accelerators for this process (default: all it sees).
        timeout_s: how long to wait for every process to connect before failing.
        heartbeat_timeout_s: a peer silent this long is declared dead and every survivor is
            terminated (non-zero exit, JAX logs which task stopped). Also bounds the hang of a
            survivor blocked in a collective with the dead peer. If the coordinator (process 0,
            which hosts JAX's coordination service) dies, every survivor terminates itself
            (SIGABRT) within ``heartbeat_timeout_s + 1`` seconds: its heartbeat to the service
            goes out every half timeout with a half-timeout deadline, and a failed one is an
            error after 1 s. A coordinator process that dies on a live host closes its socket,
            and the survivors stop at once.
        shutdown_timeout_s: how long process exit waits for the others at the final barrier.
        env: the environment to detect from (default ``os.environ``).

    Returns:
        The ``ClusterSpec`` used, or None for a single-process run.

    Raises:
        ValueError: only some of the three values are known, they are inconsistent, or a timeout
            is not a whole number of seconds >= 1.
        RuntimeError: JAX already started, or the processes could not connect in time.
    """
    spec = _resolve_spec(coordinator_address, num_processes, process_id, local_device_ids, env)
    if spec is None:
        return None
    _check_spec(spec, {"timeout_s": timeout_s, "heartbeat_timeout_s": heartbeat_timeout_s,
                       "shutdown_timeout_s": shutdown_timeout_s})
    if jax.distributed.is_initialized():
        return spec
    from .mesh import backend_started

    if backend_started():
        raise RuntimeError("sk.distributed.initialize() must run before any JAX computation (the device "
                           "set is fixed when JAX starts); call it at the top of the program")
    try:
        jax.distributed.initialize(
            spec.coordinator_address, spec.num_processes, spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids is not None else None,
            cluster_detection_method="deactivate", initialization_timeout=int(timeout_s),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s), shutdown_timeout_seconds=int(shutdown_timeout_s))
    except Exception as e:  # noqa: BLE001 - JAX raises XlaRuntimeError/RuntimeError variants
        raise RuntimeError(
            f"process {spec.process_id}/{spec.num_processes} could not join the job at "
            f"{spec.coordinator_address} within {timeout_s}s ({spec.source}): {str(e).splitlines()[0]}. "
            "Check that every process started, that they agree on the address and count, and that "
            "the port is reachable from every host.") from e
    if spec.process_id == 0:
        log.info("joined %d-process job at %s (%s)", spec.num_processes, spec.coordinator_address, spec.source)
    return spec


_barriers: dict[str, int] = {}


def barrier(name: str, timeout_s: int = 600) -> None:
    """Waits until every process reaches ``barrier(name)``; returns at once in a 1-process job.

    Uses the coordination service, not a device collective, so it is safe beside device work
    and has its own timeout. Call it before a process's first collective after uneven host work
    (a compile, a file scan): XLA:CPU's Gloo collectives exchange their peers' addresses through
    the coordination service with a fixed 30 s limit, so two processes reaching their first
    collective more than 30 s apart fail it; a barrier first makes them arrive together. Every
    process must call barriers in the same order (each name's calls are numbered).

    Raises:
        RuntimeError: a peer did not arrive within ``timeout_s`` (JAX names the missing task).
    """
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    n = _barriers[name] = _barriers.get(name, -1) + 1
    multihost.get_barrier_sync_fn()(key=f"shardkit.{name}.{n}", timeout_ms=int(timeout_s * 1000))


def is_main() -> bool:
    """True on process 0: the one that logs, prints progress and writes reports."""
    return jax.process_index() == 0


def local_rows(plan_or_sharding, global_batch: int) -> slice:
    """The rows of a global batch this process must load (its devices' shards of dimension 0).

    Args:
        plan_or_sharding: an ``sk.Plan`` (its batch layout) or the batch leaves' ``Sharding``.
        global_batch: the global batch size.

    Raises:
        ValueError: this process's rows are not one contiguous block (a mesh whose batch axis
            interleaves hosts); reorder the mesh so each host's devices are adjacent on it.
    """
    sharding = plan_or_sharding
    if not isinstance(sharding, Sharding):  # a Plan: the sharding it gives a batch's leading dim
        spec = sharding.batch_specs(jax.ShapeDtypeStruct((global_batch,), np.float32))
        sharding = sharding.sharding(spec)
    idx = sharding.addressable_devices_indices_map((global_batch,))
    starts = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop) for s in idx.values()})
    lo, hi = starts[0][0], starts[-1][1]
    covered = sum(b - a for a, b in starts)
    if covered != hi - lo:
        raise ValueError(f"process {jax.process_index()}'s batch rows {starts} are not contiguous; put each "
                         "host's devices next to each other on the batch axis (sk.make_mesh does)")
    return slice(lo, hi)


def to_global(local_batch, shardings) -> object:
    """Host-local batch (NumPy, this host's rows) → global ``jax.Array`` batch.

    ``TrainStep`` does this itself for NumPy leaves on multi-process runs; use it for other
    computations (evaluation) or to place the batch ahead of time.

    Args:
        local_batch: a pytree of NumPy arrays holding this process's rows (``local_rows``).
        shardings: one ``Sharding`` for all leaves, or a matching tree of them.
    """
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(shardings, np.asarray(x)), local_batch)
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), local_batch, shardings)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for loopback coordinators)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- shardkit launch ----------------------------------------------------------------------------

def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"


def _pump(stream, out, tag: str) -> None:
    """Copies a process's lines to ``out`` prefixed ``tag``, without the libraries' start-up
    chatter. Gloo prints into the middle of a line; the line's two halves are joined again."""
    pending = ""
    for line in iter(stream.readline, ""):
        pending = without_chatter(pending + line)
        if pending.endswith("\n"):
            out.write(f"{tag}{pending}")
            out.flush()
            pending = ""
    if pending:
        out.write(f"{tag}{pending}\n")
        out.flush()
    stream.close()


def _launch_parser() -> argparse.ArgumentParser:
    """``shardkit launch``'s arguments."""
    p = argparse.ArgumentParser(
        prog="shardkit launch", description="Run a multi-process JAX job on this machine over loopback.",
        epilog="example: shardkit launch --processes 2 --devices-per-process 4 -- python -m models.transformer")
    p.add_argument("--processes", type=int, default=2, help="number of processes (default 2)")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="simulate this many CPU devices in each process (default: the real devices)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=90.0,
                   help="seconds the others get to exit after one process fails (default 90)")
    p.add_argument("--timeout", type=float, default=None, help="wall-clock limit for the whole job, seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    return p


def _supervise(procs: list, grace: float, timeout: float | None) -> int:
    """Waits for every process; after the first failure the others get ``grace`` seconds, and
    ``timeout`` bounds the whole job, then the rest are terminated. Returns the first
    failure's exit code (128+N for signal N), 124 on a timeout, else 0."""
    start, failed_at, result = time.monotonic(), None, 0
    done: set[int] = set()
    while len(done) < len(procs):
        time.sleep(0.05)
        now = time.monotonic()
        for i, q in enumerate(procs):
            if i in done or q.poll() is None:
                continue
            done.add(i)
            if q.returncode != 0:
                print(f"shardkit launch: process {i} exited with {_describe_exit(q.returncode)} after "
                      f"{now - start:.1f}s", file=sys.stderr, flush=True)
                if failed_at is None:
                    failed_at = now
                    result = 128 - q.returncode if q.returncode < 0 else q.returncode
        late = failed_at is not None and now - failed_at > grace
        if late or (timeout is not None and now - start > timeout):
            alive = [i for i, q in enumerate(procs) if q.poll() is None]
            why = f"{grace:.0f}s after a failure" if late else f"--timeout {timeout:.0f}s"
            print(f"shardkit launch: terminating process(es) {alive} ({why})", file=sys.stderr, flush=True)
            for i in alive:
                procs[i].terminate()
            for i in alive:
                try:
                    procs[i].wait(timeout=10)
                except subprocess.TimeoutExpired:
                    procs[i].kill()
            result = result or 124
            break
    return result


def launch_main(argv: list[str]) -> int:
    """``shardkit launch``: runs ``--processes`` copies of a command as one job on this machine.

    Each copy gets ``JAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port), ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID`` (read by ``sk.distributed.initialize()``), and with
    ``--devices-per-process N`` also ``JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=N``. Output lines
    are prefixed ``[i]``. SIGINT/SIGTERM are forwarded (a SIGTERM is a preemption notice). If a
    process fails, the others get ``--grace`` seconds to exit on their own (JAX's heartbeat
    detects the loss) and are then terminated.

    Returns:
        0 if every process exited 0, else the first failure's exit code (128+N for signal N),
        or 124 on ``--timeout``.
    """
    p = _launch_parser()
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command after '--', e.g. shardkit launch --processes 2 -- python train.py")
    if a.processes < 1 or (a.devices_per_process is not None and a.devices_per_process < 1):
        p.error("--processes and --devices-per-process must be positive")
    port = a.port or free_port()
    base = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(a.processes),
                PYTHONUNBUFFERED="1")
    if a.devices_per_process:
        base.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(a.devices_per_process))
    procs, pumps = [], []
    for i in range(a.processes):
        proc = subprocess.Popen(cmd, env=dict(base, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] "), daemon=True)
            t.start()
            pumps.append(t)

    def forward(signum, frame):
        for q in procs:
            if q.poll() is None:
                q.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = _supervise(procs, a.grace, a.timeout)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for q in procs:
            if q.poll() is None:
                q.kill()
            q.wait()
        for t in pumps:
            t.join(timeout=5)
    return result


__all__ = ["ClusterSpec", "detect", "first_slurm_host", "free_port", "initialize", "is_main",
           "launch_main", "local_rows", "to_global"]
