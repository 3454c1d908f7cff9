"""Model families nobody here wrote, installed from pip, with the interface of ``families.py``
(``FAMILIES``, ``LAYOUTS``, ``build``), for ``bench/cost_bands.py`` and ``test_cost_bands.py``:

* ``resnet18``: flaxmodels' Flax Linen ResNet-18 (``pip install flaxmodels``; the ``test``
  extra), BatchNorm statistics in a mutable collection; channel-parallel rules on its convs.
* ``gpt2``: HuggingFace transformers' Flax GPT-2 (``transformers<5``: v5 removed Flax; the
  ``bench`` extra), two layers; Megatron rules on its fused q/k/v, MLP and output projections
  (its ``Conv1D`` kernels are stored ``(out, in)``).
* ``griffin``: Google DeepMind's recurrentgemma Griffin (the ``bench`` extra; installed with
  ``--no-deps``: its metadata pins numpy<2.4), a recurrent block (RG-LRU, a scan over time)
  then a local-attention block, gradient checkpointing on; Megatron rules on its MLP and
  projections, the recurrence's block-diagonal gates left replicated.
* ``bert``: HuggingFace transformers' Flax BERT masked-LM (the ``bench`` extra), two post-LN
  layers, token-type and position tables, the prediction head tied to the word embeddings;
  Megatron rules on its query/key/value, attention output and MLP projections. The held-out
  family since ResNet-18 was looked at to fix the model (issue 24). (HF's Flax ViT was tried
  first: XLA:GPU fails to tile its 17-token (CLS + 16 patches) dots, "Couldn't find output
  tile sizes", on every data-split layout.)

Each is built small (a few layers, width 64) so that a deviceless compile takes seconds.
"""

from __future__ import annotations

import importlib.util
import inspect

import numpy as np

import shardkit as sk

# (mesh, ZeRO stage): as families.LAYOUTS — DP, ZeRO-1/2/3, TP, a 3-axis hybrid.
LAYOUTS = [("data=8", 0), ("data=8", 1), ("data=8", 2), ("data=8", 3), ("tensor=8", 0),
           ("data=2,fsdp=2,tensor=2", 1)]
_NEEDS = {"resnet18": "flaxmodels", "gpt2": "transformers", "griffin": "recurrentgemma", "bert": "transformers"}


def available() -> list[str]:
    """The families whose package is installed."""
    return [f for f, pkg in _NEEDS.items() if importlib.util.find_spec(pkg) is not None]


def _tokens(rows, seq, vocab, seed=0):
    r = np.random.default_rng(seed)
    t = r.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    return {"tokens": t[:, :-1], "labels": t[:, 1:]}


def _xent(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), labels).mean()


# ---- flaxmodels ResNet-18 ----------------------------------------------------------------------

def resnet18(rows=32, size=16, classes=10, abstract=False):
    """``abstract``: the variables as shapes (``jax.eval_shape``), for a caller that only traces."""
    import flaxmodels
    import jax

    model = flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=classes, normalize=False)
    r = np.random.default_rng(0)
    batch = {"image": r.standard_normal((rows, size, size, 3)).astype(np.float32),
             "label": r.integers(0, classes, (rows,)).astype(np.int32)}
    with jax.numpy_rank_promotion("allow"):
        init = lambda: model.init(jax.random.key(0), batch["image"][:1], train=False)  # noqa: E731
        variables = jax.eval_shape(init) if abstract else jax.jit(init)()

    def loss(variables, batch):
        logits, updates = model.apply(variables, batch["image"], train=True, mutable=["batch_stats"])
        return _xent(logits, batch["label"]), {}, updates

    def rules(tp: bool):
        if not tp:
            return [(r".*", ())]
        return [(r"Conv_\d+/kernel$", (None, None, None, "tensor")), (r"BatchNorm_\d+/(scale|bias|mean|var)$",
                                                                       ("tensor",)),
                (r"Dense_\d+/kernel$", ("tensor", None)), (r".*", ())]

    return variables, loss, rules, batch


# ---- HuggingFace Flax GPT-2 ----------------------------------------------------------------------

def gpt2(rows=32, seq=32, vocab=256):
    from transformers import GPT2Config, FlaxGPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(cfg, input_shape=(1, seq), seed=0)

    def loss(params, batch):
        return _xent(model(batch["tokens"], params=params, train=False).logits, batch["labels"])

    def rules(tp: bool):
        if not tp:
            return [(r".*", ())]
        return [(r"(c_attn|c_fc)/kernel$", ("tensor", None)), (r"(c_attn|c_fc)/bias$", ("tensor",)),
                (r"c_proj/kernel$", (None, "tensor")), (r".*", ())]

    return model.params, loss, rules, _tokens(rows, seq, vocab)


# ---- recurrentgemma Griffin ----------------------------------------------------------------------

def griffin(rows=32, seq=32, vocab=256):
    import jax
    import jax.numpy as jnp
    import recurrentgemma.jax as rg

    cfg = rg.GriffinConfig(vocab_size=vocab, width=64, mlp_expanded_width=128, num_heads=4, lru_width=64,
                           attention_window_size=16, logits_soft_cap=30.0, embeddings_scale_by_sqrt_dim=True,
                           block_types=(rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION))
    model = rg.Griffin(cfg)
    tokens = _tokens(rows, seq, vocab)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, seq))
    params = jax.jit(lambda: model.init(jax.random.key(0), jnp.asarray(tokens["tokens"][:1]), pos)["params"])()

    def loss(params, batch):
        n = batch["tokens"].shape[0]
        logits, _ = model.apply({"params": params}, batch["tokens"], jnp.broadcast_to(pos, (n, seq)),
                                return_cache=False)
        return _xent(logits, batch["labels"])

    def rules(tp: bool):
        if not tp:
            return [(r".*", ())]
        return [(r"ffw_up/w$", (None, None, "tensor")), (r"ffw_up/b$", (None, None, None, "tensor")),
                (r"ffw_down/kernel$", ("tensor", None)),
                (r"(linear_x|linear_y|proj_q)/kernel$", (None, "tensor")),
                (r"(linear_out|proj_final)/kernel$", ("tensor", None)), (r".*", ())]

    return params, loss, rules, tokens


# ---- HuggingFace Flax BERT ---------------------------------------------------------------------

def bert(rows=32, seq=32, vocab=256):
    from transformers import BertConfig, FlaxBertForMaskedLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=seq, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = FlaxBertForMaskedLM(cfg, input_shape=(1, seq), seed=0)
    tokens = _tokens(rows, seq, vocab)

    def loss(params, batch):
        # Every position predicts its own token back through the tied word embeddings.
        return _xent(model(batch["tokens"], params=params, train=False).logits, batch["tokens"])

    def rules(tp: bool):
        if not tp:
            return [(r".*", ())]
        return [(r"self/(query|key|value)/kernel$", (None, "tensor")), (r"self/(query|key|value)/bias$", ("tensor",)),
                (r"intermediate/dense/kernel$", (None, "tensor")), (r"intermediate/dense/bias$", ("tensor",)),
                (r"(attention/output|layer/\d+/output)/dense/kernel$", ("tensor", None)), (r".*", ())]

    return model.params, loss, rules, tokens


FAMILIES = {"resnet18": resnet18, "gpt2": gpt2, "griffin": griffin, "bert": bert}


def build(family: str, mesh: str, zero: int, *, rows: int | None = None, strict: bool = True,
          abstract: bool = False):
    """``(step, state, batch)`` for one family on one layout (fp32, AdamW), as ``families.build``;
    ``abstract``: the state as ``ShapeDtypeStruct``s (``step.abstract_state``), nothing run —
    for a caller that only traces the step (``bench/cost_bands.py --reestimate``)."""
    import jax
    import optax

    m = sk.make_mesh(mesh)
    # Models written elsewhere rely on implicit rank promotion (tests/conftest.py raises on it):
    # allowed for their construction (HF Flax GPT-2 traces itself in __init__) and init.
    with jax.numpy_rank_promotion("allow"):
        kw = {"rows": rows} if rows else {}
        if abstract and "abstract" in inspect.signature(FAMILIES[family]).parameters:
            kw["abstract"] = True
        params, loss, rules, batch = FAMILIES[family](**kw)
        plan = sk.Plan(m, rules=rules("tensor" in m.axis_names), zero=zero, strict=strict)
        step = sk.train_step(plan, optax.adamw(1e-3))(loss)
        state = step.abstract_state(params) if abstract else step.init(params)
    return step, state, batch
