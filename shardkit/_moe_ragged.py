"""``sk.moe``'s dropless dispatch on GPU and TPU targets: only the routed rows travel and only
they meet the experts' weights (MaxText's "ragged" MoE; Megablox, Gale et al. 2023).

Per device (inside ``moe``'s shard_map over the expert axis of size ``n``): the ``N·k``
assignments are sorted by expert; an ``all_to_all`` of the per-expert counts tells each device
how many rows it gets from each peer for each of its ``E/n`` experts; ``lax.ragged_all_to_all``
sends each peer the contiguous run of rows for its experts (``output_offsets`` are where the
rows land in the *receiver's* buffer: the receiver's exclusive prefix sum over senders, sent
back with another count-sized all_to_all); the received rows, grouped by sender then expert,
are re-sorted by expert and run through ``expert_fn`` as grouped matmuls (``lax.ragged_dot``,
``_grouped``); the reverse ``ragged_all_to_all`` brings each row home, where the assignments
are unsorted and combined with their gates.

The receive buffer is static: the worst case, every peer's assignments all bound for this
device's experts, ``n · N · min(k, E/n)`` rows. What is sent is the ``N·k`` routed rows, not the
padded form's ``E · N`` (dropless pads each expert's slots to every token). XLA:CPU has no
ragged-all-to-all ("HLO opcode ragged-all-to-all is not supported by XLA:CPU"), so the CPU runs
the padded form (``moe.py``), which is also the reference this path is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._grouped import grouped_expert

F32 = jnp.float32
# The collective, a module attribute so tests can run the dispatch on XLA:CPU with an
# equivalent made of a dense all_to_all (tests/test_moe_ragged.py).
ragged_all_to_all = lax.ragged_all_to_all


def receive_rows(tokens: int, top_k: int, experts: int, axis_size: int) -> int:
    """Rows of a device's static receive buffer: every peer's ``tokens · min(k, E/n)``
    assignments bound for its experts (a token picks each expert at most once)."""
    return axis_size * tokens * min(top_k, experts // axis_size)


def top_k_gates(probs_NxE: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's ``k`` highest-scoring experts and their gates (renormalised to sum to 1 over
    the ``k`` when asked): the routing both of ``sk.moe``'s dispatchers start from."""
    top_NxK, idx_NxK = lax.top_k(probs_NxE, k)
    return (top_NxK / jnp.sum(top_NxK, axis=-1, keepdims=True) if renormalize else top_NxK), idx_NxK


def ragged_dispatcher(expert_fn, E: int, n: int, k: int, axis: str, out, renormalize: bool):
    """The per-device body, with ``moe._dispatcher``'s signature and outputs (nothing drops)."""
    Do, _ = out
    E_loc = E // n

    def local(x_NxD, probs_NxE, params):
        N, D = x_NxD.shape
        gates_NxK, idx_NxK = top_k_gates(probs_NxE, k, renormalize)
        e_A = idx_NxK.reshape(N * k)  # assignment a = token a // k, its (a % k)-th choice
        order_A = jnp.argsort(e_A, stable=True)
        x_AxD = x_NxD[order_A // k]  # the routed rows, by expert
        counts_E = jnp.zeros(E, jnp.int32).at[e_A].add(1)
        if n == 1:
            y_AxDo = grouped_expert(expert_fn, params, x_AxD, counts_E)
        else:
            y_AxDo = _exchange(expert_fn, params, x_AxD, counts_E, n, E_loc, axis, N, k, Do)
        y_NxKxDo = jnp.zeros_like(y_AxDo).at[order_A].set(y_AxDo).reshape(N, k, Do)
        y_NxDo = jnp.einsum("nk,nkd->nd", gates_NxK, y_NxKxDo.astype(F32))
        return y_NxDo.astype(x_NxD.dtype), idx_NxK, jnp.ones((N, k), bool)

    return local


def _exclusive_cumsum(a):
    return jnp.cumsum(a) - a


def _exchange(expert_fn, params, x_AxD, counts_E, n, E_loc, axis, N, k, Do):
    """Rows to their experts' devices, through the experts, and back: ``(A, Do)`` in ``x_AxD``'s
    (expert-sorted) order."""
    A, D = x_AxD.shape
    counts_nxL = counts_E.reshape(n, E_loc)  # row j: my rows for device j's experts
    send_n = jnp.sum(counts_nxL, axis=1)
    send_off_n = _exclusive_cumsum(send_n)
    got_nxL = lax.all_to_all(counts_nxL, axis, 0, 0, tiled=True)  # row i: peer i's rows for my experts
    recv_n = jnp.sum(got_nxL, axis=1)
    recv_off_n = _exclusive_cumsum(recv_n)  # where peer i's rows start in my buffer
    # ragged_all_to_all wants, per peer j, where my rows start in j's buffer: j's recv_off[me].
    dest_off_n = lax.all_to_all(recv_off_n, axis, 0, 0, tiled=True)
    M = receive_rows(N, k, n * E_loc, n)
    buf_MxD = ragged_all_to_all(x_AxD, jnp.zeros((M, D), x_AxD.dtype), send_off_n, send_n, dest_off_n,
                                recv_n, axis_name=axis)
    # The buffer holds peer 0's rows for my experts 0..L-1, then peer 1's, ...: the local expert
    # of each row from the segment it falls in; rows past the received ones sort last.
    seg_end = jnp.cumsum(got_nxL.reshape(n * E_loc))
    seg_M = jnp.searchsorted(seg_end, jnp.arange(M, dtype=seg_end.dtype), side="right")
    e_M = jnp.where(seg_M < n * E_loc, seg_M % E_loc, E_loc)
    order_M = jnp.argsort(e_M, stable=True)
    y_sorted = grouped_expert(expert_fn, params, buf_MxD[order_M], jnp.sum(got_nxL, axis=0))
    y_MxDo = jnp.zeros_like(y_sorted).at[order_M].set(y_sorted)
    # Home again: I send peer i its recv_n[i] rows from recv_off[i]; they land at i's send_off[me].
    home_off_n = lax.all_to_all(send_off_n, axis, 0, 0, tiled=True)
    return ragged_all_to_all(y_MxDo, jnp.zeros((A, Do), y_MxDo.dtype), recv_off_n, recv_n, home_off_n,
                             send_n, axis_name=axis)
