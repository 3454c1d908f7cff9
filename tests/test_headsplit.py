"""A tensor split reshaped into heads, followed dim by dim (``cost.program.reader.head_splits``): where it lands,
and the partial sums a per-head contraction leaves when the heads are fewer than the devices."""

import jax
import jax.numpy as jnp
import pytest

from shardkit.cost.program.head_splits import reshape_dims
from shardkit.cost.program.reader import read_program
from shardkit.cost.analytic.leaf_sizes import split_feature_dims


@pytest.mark.parametrize("src,dst,dims,expect", [
    ((8, 32, 64), (8, 32, 4, 16), {2: 8}, {2: 4, 3: 2}),  # 4 heads over 8 devices: 2 share a head
    ((8, 32, 64), (8, 32, 4, 16), {2: 4}, {2: 4}),  # one head a device
    ((8, 32, 64), (8, 32, 4, 16), {2: 2}, {2: 2}),
    ((8, 32, 4, 16), (8, 32, 64), {2: 4, 3: 2}, {2: 8}),  # merged back
    ((8, 32, 64), (256, 64), {2: 8}, {1: 8}),  # rows flattened: the feature keeps its split
    ((64,), (1, 1, 64), {0: 8}, {2: 8}),
])
def test_reshape_places_the_split_outermost_first(src, dst, dims, expect):
    assert reshape_dims(src, dst, dims)[0] == expect


def test_a_split_that_does_not_divide_is_not_guessed():
    assert reshape_dims((8, 6), (8, 3, 2), {1: 4})[0] is None  # 3 heads, 4 devices


B, T, D, H = 2, 8, 64, 4  # 4 heads of 16


def _loss(p, x):
    q = (x @ p["wq"]).reshape(B, T, H, D // H)  # column-parallel, split into heads
    k = x @ p["wk"]  # one key head, whole (multi-query)
    probs = jax.nn.softmax(jnp.einsum("bthd,bsd->bhts", q, k), axis=-1)
    o = jnp.einsum("bhts,bsd->bthd", probs, k).reshape(B, T, D)
    return (o @ p["wo"]).sum()  # row-parallel


def _read(tensor: int):
    params = {"wk": jax.ShapeDtypeStruct((D, D // H), jnp.float32), "wo": jax.ShapeDtypeStruct((D, D), jnp.float32),
              "wq": jax.ShapeDtypeStruct((D, D), jnp.float32)}
    weight_dims = [[], [0], [1]]  # leaves in key order: wk whole, wo rows, wq columns

    def split_of(aval, leaf, manual=frozenset()):
        if leaf is not None:
            return 1, tensor if weight_dims[leaf] else 1
        return 1, tensor if split_feature_dims(aval.shape, B, {D}) else 1

    return read_program(_loss, params, jax.ShapeDtypeStruct((B, T, D), jnp.float32), split_of=split_of,
                        n_params=3, weight_dims=weight_dims, tensor_axis=tensor,
                        feature_dims=lambda shape: split_feature_dims(shape, B, {D}))


def test_fewer_heads_than_devices_reduce_the_head_contractions():
    """With 4 heads over 4 devices a head's logits are local; over 8, two devices share each
    head's features and the logits (forward) and their gradient (backward) are partial sums."""
    r4, r8 = _read(4), _read(8)
    assert r8.tensor_reduce_ops == r4.tensor_reduce_ops + 2
    assert "head-spill" in r8.unseen and "head-spill" not in r4.unseen
    # The key's gradient sums over the heads: a reduction at 4 devices as at 8.
    assert r4.tensor_reduce_ops > 2  # wo's forward, wq's input gradient, the key's gradient
