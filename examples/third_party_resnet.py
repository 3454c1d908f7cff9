"""Train a model nobody here wrote under several layouts, with rules written by its user.

The model is ``flaxmodels.ResNet18`` (``pip install flaxmodels``): a Flax Linen ResNet with
BatchNorm, its own layer names (``BasicBlock_3/Conv_1/kernel``) and no sharding annotations —
nothing shaped like shardkit's recipes. All that shardkit needs is written below, in this file:
a table of ``(regex, spec)`` rules per layout. The data are scikit-learn's digits through the
ResNet recipe's Grain loader.

    python examples/third_party_resnet.py                      # 3 layouts, 5 steps each
    python examples/third_party_resnet.py --layouts channels --steps 50

Every layout starts from the same initial variables and sees the same batches; the script prints
each plan (``plan.describe``: the rule that placed every array), the step's compiled cost
(``step.explain``) and the losses. The losses agree closely over the first steps, then drift
apart: flaxmodels' BatchNorm computes the variance as E[x²] − E[x]², which cancels where a
channel's variance is small next to its mean (the digits' constant borders), so the order in
which a layout sums the batch changes the result beyond float32 rounding. Measured at batch 32:
within 1e-5 of data parallel over three steps, 3.6e-3 apart at the fourth (compiled at LLVM
-O0, as the tests compile, the channel layout is already 1.5e-3 apart at the second); at batch 16 the
first gradients of data=8 and a single device already differ by 1% (data=4,tensor=2: 7e-6);
with the variance computed in two passes (E[(x − E[x])²], patched in for the check) every
layout's first gradients match the single device's to 5e-6 to 7e-6.
"""

from __future__ import annotations

import argparse
import sys

import shardkit as sk

# Layouts: mesh, ZeRO stage, and the user's rules for this model's parameter paths. The
# Linen variables are {"params": ..., "batch_stats": ...}; a rule matches anywhere in the
# '/'-joined path, first match wins, and anything no rule matches is an error, not replicated.
LAYOUTS = {
    # plain data parallel: replicate everything, on purpose
    "dp": ("data=8", 0, [(r".*", ())]),
    # FSDP: ZeRO-3 shards every parameter over the data axes by itself; the rules only say
    # "no model parallelism"
    "fsdp": ("data=2,fsdp=4", 3, [(r".*", ())]),
    # channel (tensor) parallel: every conv's output channels, the BatchNorm vectors that follow
    # them, and the classifier's input rows split over `tensor`; the batch over `data`
    "channels": ("data=4,tensor=2", 1, [
        (r"Conv_\d+/kernel$", (None, None, None, "tensor")),        # (kh, kw, in, OUT)
        (r"BatchNorm_\d+/(scale|bias|mean|var)$", ("tensor",)),      # per output channel
        (r"Dense_\d+/kernel$", ("tensor", None)),                    # (IN, classes)
        (r".*", ()),                                                  # the classifier bias
    ]),
}


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Trains every layout asked for; returns ``{layout: losses}``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, among {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--explain", choices=("all", "last", "none"), default="all",
                   help="print the compiled memory, collectives and flops of every layout's step, the last one's, or none")
    args = p.parse_args(argv)
    names = args.layouts.split(",")
    if unknown := [n for n in names if n not in LAYOUTS]:
        p.error(f"unknown layouts {unknown}; choose among {', '.join(LAYOUTS)}")
    try:
        sk.use_cpu_devices(8)
    except (ValueError, RuntimeError):
        pass  # JAX already started (a notebook, a test): use the devices it has

    import flaxmodels
    import jax
    import numpy as np
    import optax

    from models.resnet.data import digits

    ds = digits(args.image_size, shift=0)
    it = ds.batches(args.batch, seed=0)
    batches = [next(it) for _ in range(args.steps)]
    model = flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=ds.num_classes, normalize=False)
    variables = jax.jit(lambda: model.init(jax.random.key(0), batches[0]["image"][:1], train=False))()

    def loss_fn(variables, batch):
        logits, updates = model.apply(variables, batch["image"], train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = (logits.argmax(-1) == batch["label"]).mean()
        return loss, {"accuracy": accuracy}, updates  # Linen with a mutable collection

    results = {}
    for name in names:
        mesh_spec, zero, rules = LAYOUTS[name]
        plan = sk.Plan(sk.make_mesh(mesh_spec), rules=sk.PathRules(rules), zero=zero)
        step = sk.train_step(plan, optax.sgd(0.01, momentum=0.9))(loss_fn)
        state = step.init(variables)
        print(f"\n=== {name}: mesh {mesh_spec}, ZeRO-{zero} ===")
        print(plan.describe(state.params))
        if args.explain == "all" or args.explain == "last" and name == names[-1]:
            # before training: the step keeps the program explain compiled and trains with it
            # (one compile of ResNet-18's step where explaining afterwards took a second)
            print(step.explain(state, batches[0]))
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results[name] = losses
    first = results[names[0]]
    print(f"\n{'layout':10} {'loss first → last':>20}  max |Δ| vs {names[0]}")
    for name, losses in results.items():
        print(f"{name:10} {losses[0]:9.4f} → {losses[-1]:7.4f}  {np.max(np.abs(np.subtract(losses, first))):.1e}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
