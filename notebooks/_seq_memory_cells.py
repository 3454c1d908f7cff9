"""Notebook 08's cells (``_build.py`` reads ``NAME``, ``CELLS`` and ``CHECK`` from here): the
recipe's 7B memory per device against sequence length, read from
``bench/results/seq_memory.json`` (``python bench/seq_memory.py``: the compiles take minutes
each, so the notebook only reads and plots them)."""

NAME = "08_memory_vs_sequence_7b"

LOAD = '''import json, pathlib
import matplotlib.pyplot as plt

GiB = 2 ** 30
data = json.loads((pathlib.Path(sk.__file__).resolve().parents[1] / "bench/results/seq_memory.json").read_text())
points = data["points"]
for command in sorted({p["command"] for p in points}):
    print(command)

def series(target, cp, remat):
    return sorted((p for p in points if (p["target"], p["cp"], p["remat"]) == (target, cp, remat)),
                  key=lambda p: p["seq"])

def compiled(p, what="peak"):
    return (p.get("compiled") or {}).get(what)

device_memory = {p["target"]: p["compiled"]["device_memory"] for p in points if compiled(p, "device_memory")}
kinds = sorted({(p["target"], p["cp"], p["remat"]) for p in points})'''

TABLE = '''g = lambda v: "–" if v is None else f"{v / GiB:7.2f}"
print(f"{'target':8} {'mesh':17} {'remat':5} {'seq':>7} | {'compiled':>8} {'explain':>8} {'shape':>8} | fits")
for target, cp, remat in kinds:
    for p in series(target, cp, remat):
        c = p.get("compiled") or {}
        fits = {True: "yes", False: "no"}.get(c.get("fits"), "did not compile: " + c.get("error", "not run")[:90])
        print(f"{target:8} {p['mesh']:17} {remat:5} {p['seq']:7,} | {g(c.get('peak'))} "
              f"{g((c.get('explain_estimate') or {}).get('peak'))} {g(p['model_shape']['peak'])} | {fits}")'''

PLOT = '''fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
styles = {(False, "dots"): ("C0", "no CP (data=64), remat dots"), (True, "none"): ("C3", "CP (data=8,context=8), remat none"),
          (False, "none"): ("C2", "no CP (data=64), remat none"), (True, "dots"): ("C1", "CP (data=8,context=8), remat dots")}
for ax, target in zip(axes, ("h100", "tpu-v5p")):
    for (t, cp, remat) in kinds:
        if t != target:
            continue
        colour, label = styles[(cp, remat)]
        s = series(target, cp, remat)
        ok = [p for p in s if compiled(p) is not None]
        ax.plot([p["seq"] for p in ok], [compiled(p) / GiB for p in ok], "o-", color=colour, label=label + ": compiled")
        ax.plot([p["seq"] for p in ok], [p["compiled"]["explain_estimate"]["peak"] / GiB for p in ok], "--",
                color=colour, alpha=0.7, label="  explain() estimate")
        ax.plot([p["seq"] for p in s], [p["model_shape"]["peak"] / GiB for p in s], ":", color=colour,
                alpha=0.7, label="  ModelShape estimate")
        failed = [p for p in s if compiled(p) is None]
        ax.plot([p["seq"] for p in failed], [p["model_shape"]["peak"] / GiB for p in failed], "x", color=colour,
                markersize=9, label="  did not compile (at the estimate)" if failed else None)
    if target in device_memory:
        ax.axhline(device_memory[target] / GiB, color="k", lw=1)
        ax.text(4096, device_memory[target] / GiB * 1.08, f"{target} memory {device_memory[target] / GiB:.1f} GiB")
    ax.set_xscale("log", base=2); ax.set_yscale("log")
    ax.set_xticks([p["seq"] for p in series(*kinds[0])], [f"{p['seq'] // 1024}K" for p in series(*kinds[0])])
    ax.set_title({"h100": "64 H100s (XLA:GPU)", "tpu-v5p": "v5p, 64 chips (XLA:TPU)"}[target])
    ax.set_xlabel("sequence length (tokens)")
axes[0].set_ylabel("peak memory per device (GiB)")
axes[1].legend(fontsize=7, loc="upper left")
fig.tight_layout()
fig'''

CELLS = [
    ("md", "# 08 — The 7B's memory per device against sequence length, H100 and v5p\n\n"
           "The recipe's `7b` (32 layers, d=4096, 32 heads of 128, vocab 32,000, AdamW, bf16, ZeRO-3) "
           "on 64 devices at 4K–128K tokens a sequence, compiled deviceless by XLA:GPU for H100s and "
           "XLA:TPU for a v5p slice, with the defaults `attention=\"auto\"` (Pallas flash: Triton on "
           "GPU, Mosaic on TPU) and the chunked loss. Without context parallelism (CP) each device "
           "holds one whole sequence (`data=64`); with it a sequence is split over 8 devices "
           "(`data=8,context=8`, `sk.context_attention`'s ring). Beside each compiled peak, "
           "`explain()`'s estimate of the same traced program and the `ModelShape` estimate "
           "(`sk.cost.estimate` from the config, no trace). A 7B compile takes about a minute "
           "here, so this notebook reads the figures `python bench/seq_memory.py` wrote (the commands "
           "below) and compiles nothing."),
    ("code", "import shardkit as sk; sk.use_cpu_devices(8)\n" + LOAD),
    ("md", "Every point, GiB per device: the compiled peak (arguments + outputs − aliased + "
           "temporaries), `explain()`'s estimate, the `ModelShape` estimate; a point that did not "
           "compile says why."),
    ("code", TABLE),
    ("code", PLOT),
]

CHECK = '''# placeholder: written once the figures are in'''
