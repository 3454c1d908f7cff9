"""The transformer recipe: model pieces, data, hardware table, layouts against a 1-device run,
golden sharding snapshots, flop count, and the training entry point.

Golden snapshots live in tests/golden/transformer_125m_<layout>.json. After a deliberate
layout change, regenerate them with

    SHARDKIT_UPDATE_GOLDEN=1 python -m pytest tests/test_transformer.py -k golden
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.transformer import data as data_lib
from models.transformer.config import SIZES, Config
from models.transformer.model import (Transformer, apply_rotary, flops_per_token, loss_fn,
                                      param_count, rotary)
from shardkit import hardware

CFG = SIZES["test"]  # d_model 32, 2 layers, 4 heads / 2 kv heads, seq 16


def build(cfg: Config = CFG, seed: int = 0) -> Transformer:
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(seed))


def tokens(B: int, T: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab, dtype=jnp.int32)


# ---- model --------------------------------------------------------------------------------

def test_shapes_and_param_count():
    model = build()
    assert model(tokens(3, CFG.seq)).shape == (3, CFG.seq, CFG.vocab)
    params = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == param_count(CFG)
    assert params["blocks"]["attn"]["k"].shape == (CFG.layers, CFG.d_model, CFG.kv_heads, CFG.head_dim)
    untied = build(CFG.replace(tie_embeddings=False))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(untied, nnx.Param))) == param_count(
        CFG) + CFG.vocab * CFG.d_model


def test_every_param_has_logical_axes():
    state = nnx.state(build(), nnx.Param)
    names = jax.tree.leaves(jax.tree.map(lambda v: v.get_metadata()["out_sharding"], state,
                                         is_leaf=lambda v: isinstance(v, nnx.Variable)),
                            is_leaf=lambda x: isinstance(x, tuple))
    leaves = jax.tree.leaves(state)
    assert len(names) == len(leaves)
    for n, leaf in zip(names, leaves):
        assert len(n) == leaf.ndim
    assert ("layers", "embed", "heads", "head_dim") in names


def test_causal_mask():
    model = build()
    x = tokens(2, CFG.seq)
    y = x.at[:, 9].set((x[:, 9] + 1) % CFG.vocab)
    a, b = model(x), model(y)
    np.testing.assert_allclose(a[:, :9], b[:, :9], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 9:], b[:, 9:])


def test_rotary_is_relative():
    """q·k after rotary depends on positions only through their difference."""
    Q, T = 8, 12
    cos, sin = rotary(T, Q, 10_000.0)
    q = jax.random.normal(jax.random.key(1), (1, 1, 1, Q))
    k = jax.random.normal(jax.random.key(2), (1, 1, 1, Q))
    at = lambda v, pos: apply_rotary(jnp.broadcast_to(v, (1, T, 1, Q)), cos, sin)[0, pos, 0]  # noqa: E731
    d1 = jnp.dot(at(q, 5), at(k, 2))
    d2 = jnp.dot(at(q, 10), at(k, 7))
    np.testing.assert_allclose(d1, d2, rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(at(q, 7)), jnp.linalg.norm(q), rtol=1e-5)


def test_grouped_query_equals_repeated_kv_heads():
    gqa = build()
    mha = build(CFG.replace(kv_heads=CFG.heads))
    pure = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))
    for name in ("k", "v"):  # query head h reads kv head h // G
        pure["blocks"]["attn"][name] = jnp.repeat(pure["blocks"]["attn"][name], CFG.groups, axis=2)
    state = nnx.state(mha, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(mha, state)
    x = tokens(2, CFG.seq)
    np.testing.assert_allclose(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_scan_matches_python_loop_and_remat():
    model = build(CFG.replace(layers=3))
    x = tokens(2, CFG.seq)
    h = model.embed_tokens(x)
    layer = model.layer_fn(CFG.seq)
    params = nnx.state(model.blocks)
    for i in range(3):
        h = layer(jax.tree.map(lambda a: a[i], params), h)
    np.testing.assert_allclose(model.hidden(x), h, rtol=1e-5, atol=1e-5)

    batch = {"inputs": x, "targets": tokens(2, CFG.seq, seed=1)}
    grad = lambda m: nnx.grad(loss_fn)(m, batch)  # noqa: E731
    g_plain = grad(model)
    g_remat = grad(build(CFG.replace(layers=3, remat="full")))
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_config_errors():
    with pytest.raises(ValueError, match="kv_heads"):
        Config(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="remat"):
        Config(remat="sometimes")
    assert CFG.replace(d_model=64).head_dim == 16


# ---- data -----------------------------------------------------------------------------------

def test_stdlib_corpus_split_and_batches():
    train, val = data_lib.stdlib_corpus(max_bytes=1 << 20)
    assert train.dtype == np.uint8 and len(train) > 10 * len(val) > 0
    it = data_lib.Batches(train, batch=4, seq=16, seed=3)
    first = [next(it) for _ in range(3)]
    pos = it.position()
    assert json.loads(json.dumps(pos)) == pos
    after = next(it)
    resumed = data_lib.Batches(train, batch=4, seq=16, seed=0)
    resumed.restore(pos)
    np.testing.assert_array_equal(next(resumed)["inputs"], after["inputs"])
    np.testing.assert_array_equal(first[0]["inputs"][:, 1:], first[0]["targets"][:, :-1])
    # two processes' halves make up the single-process batch
    halves = [data_lib.Batches(train, 4, 16, 3, process_index=i, process_count=2).batch_at(0)
              for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), first[0]["inputs"])


def test_token_and_text_files(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 300
    ids.tofile(tmp_path / "toks.bin")
    train, val = data_lib.load_tokens(tmp_path / "toks.bin", vocab=300)
    assert len(train) + len(val) == 1000 and train.dtype == np.uint16
    with pytest.raises(data_lib.DataError, match="vocab"):
        data_lib.load_tokens(tmp_path / "toks.bin", vocab=256)
    (tmp_path / "a.txt").write_text("hello world " * 20)
    train, _ = data_lib.load_tokens(tmp_path / "a.txt")
    assert bytes(train[:5]) == b"hello"
    with pytest.raises(data_lib.DataError, match="does not exist"):
        data_lib.load_tokens(tmp_path / "missing.bin")


# ---- hardware -------------------------------------------------------------------------------

def test_hardware_table():
    assert hardware.peak_flops("h100") == 989e12
    assert hardware.lookup("TPU v5 lite").name == "tpu-v5e"
    assert hardware.lookup("NVIDIA H200").hbm_bytes == 141e9
    with pytest.raises(ValueError, match="register_hardware"):
        hardware.lookup("abacus")
    hw = hardware.register_hardware(hardware.Hardware("test-chip", 1e12, 1e9, 1e9, 1e8, ("testchip",)),
                                    overwrite=True)
    assert hardware.lookup("my TestChip rev2") == hw
    assert hardware.peak_flops(jax.devices()[0]) > 0


def test_flops_formula():
    cfg = SIZES["125m"]
    # 6N with N ≈ 85M layer weights + 38.6M head, plus 12·L·H·Q·T attention.
    assert flops_per_token(cfg) == pytest.approx(6 * 123.5e6 + 12 * 12 * 768 * 1024, rel=0.01)
