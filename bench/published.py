"""Step time against published training runs: the analytic estimate (``sk.cost.estimate``) on
the exact configuration of runs whose throughput was published, calibration and validation
points kept apart.

Calibration rows are the runs the ``steptime.EFFICIENCY`` constants were set from (its
docstring names them); validation rows are other runs, never used to set a constant. Each row
carries its source (paper / report + table), the configuration as published (model dims,
sequence, global batch, TP/PP/DP/FSDP, microbatch, schedule, recompute, hardware) and the
published figure in the source's own unit and flop-counting convention. The published figure is
turned into seconds per step with that convention (``published_seconds``); the estimate's step
time is turned back into the source's unit, and the error is estimated / published − 1 (positive:
the model is too optimistic).

    python bench/published.py            # both tables, validation summary, JSON
    python bench/published.py --json PATH

Writes bench/results/published.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardkit import cost  # noqa: E402

SOURCES = {
    "megatron21": "Narayanan et al. 2021 (arXiv:2104.04473), Table 1; configs from the authors' "
                  "artifact, Megatron-LM examples/sc21/run_table_1.sh",
    "korthikanti22": "Korthikanti et al. 2022 (arXiv:2205.05198), Table 4 iteration times on the "
                     "Table 3 configs (interleaving as in Calculon's validation/ files)",
    "mcore24": "Megatron-LM README, H100 weak-scaling table (images/model_table.png, 2024-07, "
               "Megatron-Core r0.8.0)",
    "torchtitan24": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3",
    "maxtext24": "MaxText configs/a3/llama_2_7b/README.md and {1,2,4,8,16}vm.sh (commit efb6d9e4a, "
                 "2024-04)",
}

# How each source counts the flops behind its TFLOP/s figure (per step, whole job).
CONVENTIONS = {
    "megatron21": "96·B·s·l·h²·(1 + s/6h + V/16lh): Narayanan 2021 App. A, counts the recompute "
                  "forward; non-causal attention",
    "mcore24": "72·B·s·l·h²·(1 + s/6h + V/12lh): Megatron's num_floating_point_operations; no "
               "recompute, non-causal attention",
    "maxtext24": "(6·N_all + 6·L·H·Q·T)·T·B: MaxText calculate_tflops_training_per_device at "
                 "efb6d9e4a; N_all counts the embedding table, causal attention halved",
    "korthikanti22": "seconds per iteration (no flop convention)",
    "torchtitan24": "tokens/s per GPU (no flop convention)",
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published training run, as published.

    Attributes:
        key: short name.
        source: a key of ``SOURCES`` (paper/report and table).
        role: ``"calibration"`` (the current constants were set from it) or ``"validation"``.
        hardware: the ``sk.cost`` hardware entry it ran on.
        arch: ``"gpt"`` (GELU MLP of 4h, 2 matrices; Megatron's GPT) or ``"llama"`` (SwiGLU, 3
            matrices, RoPE, RMS norm, grouped-query attention).
        d_model, layers, heads, kv_heads, d_ff, vocab, seq: model dims and sequence length.
        tie: input embedding shared with the output head.
        positions: learned position-embedding rows (Megatron-2021 GPT: ``seq``).
        global_batch: sequences per step.
        tensor, pipe, data, fsdp: parallel degrees (``data`` across replicas, ``fsdp`` sharding).
        microbatch: sequences per microbatch and replica.
        virtual: interleaved-1F1B model chunks per stage (1: plain 1F1B, or no pipeline).
        recompute: ``"full"``, ``"selective"`` (Korthikanti's: attention core only) or ``"none"``
            (``"op-sac"``: torchtitan's per-op selective checkpointing).
        zero: ZeRO stage whose traffic the framework's optimizer has (Megatron's distributed
            optimizer reduce-scatters gradients and gathers parameters: 2).
        sequence_parallel: Megatron sequence parallelism.
        flash: the attention kernel skips masked blocks (executed attention flops halved).
        value, unit: the published figure: ``"tflops/gpu"``, ``"tokens/s/gpu"`` or ``"s/step"``.
        fit: for a calibration row, whether the refit uses it (``note`` says why not).
        note: assumptions and mapping choices.
    """

    key: str
    source: str
    role: str
    hardware: str
    arch: str
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    tie: bool
    positions: int
    global_batch: int
    tensor: int
    pipe: int
    data: int
    fsdp: int
    microbatch: int
    virtual: int
    recompute: str
    zero: int
    sequence_parallel: bool
    flash: bool
    value: float
    unit: str
    fit: bool = True
    note: str = ""

    @property
    def devices(self) -> int:
        return self.tensor * self.pipe * self.data * self.fsdp

    @property
    def microbatches(self) -> int:
        """Microbatches per replica and step (gradient accumulation or pipeline)."""
        return self.global_batch // (self.data * self.fsdp * self.microbatch)


def _megatron21(key, h, l, a, t, p, gpus, batch, mbs, v, tflops, role="validation"):
    return Run(f"megatron21-{key}", "megatron21", role, "a100", "gpt", h, l, a, a, 4 * h, 51200,
               2048, True, 2048, batch, t, p, gpus // (t * p), 1, mbs, v, "full", 0, False, False,
               tflops, "tflops/gpu",
               note="fp16, full recompute (--recompute-method uniform), interleaved 1F1B with "
                    f"{l // p // v if p > 1 else l} layers per virtual stage" if v > 1 else
                    "fp16, full recompute (--recompute-method uniform)" + (", 1F1B" if p > 1 else ""))


def _korthikanti(key, h, l, a, p, gpus, batch, mbs, v, seconds, selective):
    mode = "seqsel" if selective else "full"
    return Run(f"korthikanti22-{key}-{mode}", "korthikanti22", "validation", "a100", "gpt", h, l,
               a, a, 4 * h, 51200, 2048, True, 2048, batch, 8, p, gpus // (8 * p), 1, mbs, v,
               "selective" if selective else "full", 0, selective, False, seconds, "s/step",
               note="sequence parallelism + selective recompute (attention core recomputed: "
                    "~2-3% flops, not modelled)" if selective else "full recompute, no SP")


def _mcore24(key, a, h, l, t, p, gpus, batch, tflops):
    d = gpus // (t * p)
    return Run(f"mcore24-{key}", "mcore24", "calibration", "h100", "gpt", h, l, a, a, 4 * h, 131072,
               4096, False, 0, batch, t, p, d, 1, 1, 1, "none", 2, t > 1, True, tflops,
               "tflops/gpu", fit=p == 1,
               note="distributed optimizer, overlapped DP/TP comms; microbatch, interleaving and "
                    "recompute not published (assumed 1, none, none)"
                    + ("; pipelined: not fitted (microbatches and chunks unknown)" if p > 1 else ""))


def _maxtext(nodes, tflops):
    return Run(f"maxtext24-llama2-7b-{nodes}node", "maxtext24", "validation", "h100-a3", "llama",
               4096, 32, 32, 32, 11008, 32000, 4096, False, 0, 4 * 8 * nodes, 1, 1, nodes, 8, 4,
               1, "none", 0, False, True, tflops, "tflops/gpu",
               note="ici_fsdp=8, dcn_data=nodes, per_device_batch 4, remat minimal_flash (saves "
                    "the matmuls), cudnn flash attention; A3 High VMs (GPUDirect-TCPX)")


def _torchtitan(gpus, tps, compiled):
    return Run(f"torchtitan24-llama3.1-8b-{gpus}gpu-{'compile' if compiled else 'eager'}",
               "torchtitan24", "calibration", "h100", "llama", 4096, 32, 32, 8, 14336, 128256, 8192,
               False, 0, 2 * gpus, 1, 1, 1, gpus, 2, 1, "op-sac", 3, False, True, tps,
               "tokens/s/gpu", fit=False,
               note="FSDP2, local batch 2, selective (per-op) checkpointing; H100 96 GB HBM2e at "
                    "500 W whose peak lies between the SXM and NVL figures (the source): shown, "
                    "not fitted against the 989 TFLOP/s SXM peak")


RUNS: tuple[Run, ...] = (
    # Narayanan et al. 2021, Table 1 (A100 80 GB, Selene: 8 GPUs per node, 8 x 200 Gb/s HDR IB).
    _megatron21("1.7b", 2304, 24, 24, 1, 1, 32, 512, 16, 1, 137),
    _megatron21("3.6b", 3072, 30, 32, 2, 1, 64, 512, 16, 1, 138),
    _megatron21("7.5b", 4096, 36, 32, 4, 1, 128, 512, 16, 1, 142),
    _megatron21("18.4b", 6144, 40, 48, 8, 1, 256, 1024, 8, 1, 135),
    _megatron21("39.1b", 8192, 48, 64, 8, 2, 512, 1536, 4, 1, 138),
    _megatron21("76.1b", 10240, 60, 80, 8, 4, 1024, 1792, 2, 3, 140),
    _megatron21("145.6b", 12288, 80, 96, 8, 8, 1536, 2304, 2, 2, 148),
    _megatron21("310.1b", 16384, 96, 128, 8, 16, 1920, 2160, 1, 2, 155),
    _megatron21("529.6b", 20480, 105, 128, 8, 35, 2520, 2520, 1, 3, 163),
    _megatron21("1t", 25600, 128, 160, 8, 64, 3072, 3072, 1, 1, 163, role="calibration"),
    # Korthikanti et al. 2022, A100 80 GB (Selene), s = 2048, V = 51,200: full recompute, then
    # sequence parallelism + selective recompute.
    *(_korthikanti(k, h, l, a, p, g, b, mb, v, times[sel], sel) for sel in (False, True)
      for k, h, l, a, p, g, b, mb, v, times in (
          ("22b", 6144, 48, 64, 1, 8, 4, 4, 1, (1.42, 1.10)),
          ("175b", 12288, 96, 96, 8, 64, 64, 1, 3, (18.13, 13.75)),
          ("530b", 20480, 105, 128, 35, 280, 280, 1, 3, (49.05, 37.83)),
          ("1t", 25600, 128, 160, 64, 512, 512, 1, 1, (94.42, 71.49)))),
    # Megatron-Core on H100 (2024), V = 131,072, s = 4096, data-parallel size 48.
    _mcore24("1.7b", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _mcore24("7.1b", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _mcore24("16b", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _mcore24("32b", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _mcore24("70b", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _mcore24("119b", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _mcore24("177b", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _mcore24("314b", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _mcore24("462b", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    # torchtitan, Llama 3.1 8B, bf16 rows only (Float8 rows use another peak).
    _torchtitan(8, 5762, False), _torchtitan(8, 6667, True),
    _torchtitan(128, 5605, False), _torchtitan(128, 6514, True),
    # MaxText Llama2-7B on A3 (8 x H100 80 GB per VM).
    _maxtext(1, 492), _maxtext(2, 422), _maxtext(4, 407), _maxtext(8, 409), _maxtext(16, 375),
)


def check(run: Run) -> list[str]:
    """What is inconsistent in a row's configuration (empty when nothing is)."""
    bad = []
    if run.role not in ("calibration", "validation"):
        bad.append(f"role {run.role!r}")
    if run.d_model % run.heads or run.heads % run.kv_heads:
        bad.append(f"d_model {run.d_model} / heads {run.heads} / kv_heads {run.kv_heads}")
    if run.global_batch % (run.data * run.fsdp * run.microbatch):
        bad.append(f"global batch {run.global_batch} over {run.data * run.fsdp} replicas x "
                   f"microbatch {run.microbatch}")
    if run.layers % (run.pipe * run.virtual):
        bad.append(f"{run.layers} layers over pipe {run.pipe} x {run.virtual} chunks")
    if run.pipe > 1 and run.virtual > 1 and run.microbatches % run.pipe:
        bad.append(f"interleaved schedule needs microbatches ({run.microbatches}) divisible by "
                   f"pipe ({run.pipe})")
    if run.heads % run.tensor:
        bad.append(f"heads {run.heads} over tensor {run.tensor}")
    if run.source not in SOURCES or run.hardware not in cost.hardware.HARDWARE:
        bad.append(f"source {run.source!r} / hardware {run.hardware!r}")
    return bad


def model(run: Run) -> cost.ModelShape:
    """The run's model with the flops it executes per token before recompute (the estimate adds
    recompute): 6 x matmul weights (Kaplan et al. 2020; the head included, lookups not) plus
    attention 12·L·H·Q·T (PaLM, app. B), halved when a flash kernel skips masked blocks.

    Megatron's GPT (MLP of two h x 4h matrices) is built here, not with ``model_shape`` (whose
    MLP has three matrices): its per-token flops are Narayanan et al.'s 72·l·h²(1 + s/6h +
    V/12lh)."""
    h, l, s, V = run.d_model, run.layers, run.seq, run.vocab
    attention = (6.0 if run.flash else 12.0) * l * h * s
    if run.arch == "gpt":
        per_layer = 12 * h * h + 13 * h
        table = V * h * (1 if run.tie else 2)
        params = l * per_layer + table + run.positions * h + 2 * h
        return cost.ModelShape(run.key, float(params), 72.0 * l * h * h + attention + 6.0 * h * V,
                               l, float(l * per_layer), h, run.heads, 4 * h, V, s,
                               embedding_params=float(V * h + run.positions * h), head=True,
                               tie=run.tie)
    cfg = types.SimpleNamespace(d_model=h, layers=l, heads=run.heads, kv_heads=run.kv_heads,
                                d_ff=run.d_ff, vocab=V, seq=s, tie=run.tie, head_dim=None)
    ms = cost.model_shape(cfg)
    return dataclasses.replace(ms, name=run.key,
                               flops_per_token=ms.flops_per_token - 12.0 * l * h * s + attention)


def layout(run: Run) -> cost.Layout:
    """The closest ``Layout``: Megatron's interleaved 1F1B with v chunks is ``"circular"`` with
    ``repeats=v`` (same bubble (p − 1)/(v·m), Narayanan et al. 2021) and plain 1F1B is
    ``"gpipe"`` (same bubble; ``sk.pipeline``'s ``"1f1b"`` recomputes each stage's forward,
    which Megatron does not). Without a pipeline Megatron, MaxText and torchtitan reduce
    gradients once per step, so the layout has one microbatch (``Layout.microbatches`` would
    reduce per microbatch). Torchtitan's per-op selective checkpointing (every other matmul
    recomputed) is ``remat="dots"``; Korthikanti's selective recompute (attention core only,
    ~2-3% flops) is ``"none"``."""
    remat = {"full": "full", "op-sac": "dots"}.get(run.recompute, "none")
    piped = run.pipe > 1
    return cost.Layout(data=run.data, fsdp=run.fsdp, tensor=run.tensor, pipe=run.pipe,
                       zero=run.zero, microbatches=run.microbatches if piped else 1,
                       schedule="circular" if piped and run.virtual > 1 else "gpipe",
                       repeats=run.virtual if piped else 1, remat=remat,
                       sequence_parallel=run.sequence_parallel)


def source_flops(run: Run) -> float:
    """Flops of one step in the source's own convention (``CONVENTIONS``)."""
    B, s, l, h, V = run.global_batch, run.seq, run.layers, run.d_model, run.vocab
    if run.source == "megatron21":
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    if run.source == "mcore24":
        return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    if run.source == "maxtext24":
        q = h // run.heads
        per_layer = 4 * h * h + 3 * h * run.d_ff + 2 * h  # llama2: q, k, v, o; gate, up, down; 2 norms
        n_all = l * per_layer + 2 * V * h + h
        return (6.0 * n_all + 6.0 * l * run.heads * q * s) * s * B
    raise ValueError(f"{run.key}: the source reports {run.unit}, not flops")


def published_seconds(run: Run) -> float:
    """The published figure as seconds per step."""
    if run.unit == "s/step":
        return run.value
    if run.unit == "tokens/s/gpu":
        return run.global_batch * run.seq / run.devices / run.value
    return source_flops(run) / (run.devices * run.value * 1e12)


def in_source_unit(run: Run, seconds: float) -> float:
    """A step time in the source's unit."""
    if run.unit == "s/step":
        return seconds
    if run.unit == "tokens/s/gpu":
        return run.global_batch * run.seq / run.devices / seconds
    return source_flops(run) / (run.devices * seconds) / 1e12


def evaluate(run: Run, **estimate_kw) -> dict:
    """The estimate of one run next to its published figure."""
    est = cost.estimate(model(run), layout(run), run.hardware, global_batch=run.global_batch,
                        precision="bf16", **estimate_kw)
    published = published_seconds(run)
    t = est.time
    return {"key": run.key, "role": run.role, "fit": run.fit, "source": run.source,
            "hardware": run.hardware, "devices": run.devices, "layout": str(layout(run)),
            "unit": run.unit, "published": run.value,
            "estimated": in_source_unit(run, est.step_time),
            "error": published / est.step_time - 1.0,
            "published_s": published, "estimated_s": est.step_time,
            "compute_s": t["compute"], "bubble_s": t["bubble"], "exposed_s": t["exposed"],
            "pipe_s": sum(t[k] for k in ("pipe-permute", "pipe-reduce", "pipe-relayout")),
            "note": run.note}


def summary(rows: list[dict]) -> dict:
    """Mean and max |error| and the bias (mean error) of a set of rows."""
    errs = [r["error"] for r in rows]
    return {"n": len(errs), "mean_abs": sum(map(abs, errs)) / len(errs),
            "max_abs": max(map(abs, errs)), "bias": sum(errs) / len(errs),
            "within_15pct": sum(abs(e) <= 0.15 for e in errs)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "published.json"))
    args = p.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    bad = {r.key: check(r) for r in RUNS if check(r)}
    if bad:
        raise ValueError(f"inconsistent rows: {bad}")
    rows = [evaluate(r) for r in RUNS]
    console = Console(width=160)
    out = {"sources": SOURCES, "conventions": CONVENTIONS, "rows": rows}
    for role in ("calibration", "validation"):
        sel = [r for r in rows if r["role"] == role]
        table = Table(title=f"{role} ({len(sel)} runs): estimated vs published")
        for c in ("run", "hw", "GPUs", "layout", "unit", "published", "estimated", "error",
                  "compute s", "bubble s", "exposed s"):
            table.add_column(c, justify="left" if c in ("run", "hw", "layout", "unit") else "right")
        for r in sel:
            fmt = "{:.2f}" if r["unit"] == "s/step" else "{:,.0f}" if r["unit"] == "tokens/s/gpu" else "{:.1f}"
            table.add_row(r["key"] + ("" if r["fit"] or role == "validation" else " *"), r["hardware"],
                          str(r["devices"]), r["layout"], r["unit"], fmt.format(r["published"]),
                          fmt.format(r["estimated"]), f"{r['error']:+.1%}", f"{r['compute_s']:.3g}",
                          f"{r['bubble_s']:.3g}", f"{r['exposed_s']:.3g}")
        console.print(table)
        s = summary(sel)
        out[role] = s
        console.print(f"{role}: n={s['n']}  mean |error| {s['mean_abs']:.1%}  max |error| "
                      f"{s['max_abs']:.1%}  bias {s['bias']:+.1%}  within ±15%: "
                      f"{s['within_15pct']}/{s['n']}")
    console.print("* calibration rows shown but not fitted (see their note)")
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    console.print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
