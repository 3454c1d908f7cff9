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
the model is too optimistic). The estimate includes ``steptime.memory_bound_time`` (``estimate`` adds it
for every transformer shape); the tables also show the estimate without it and, for
pipelined runs, a diagnostic with the pipeline traffic Megatron sends (``megatron_p2p_seconds``).
The scale rows (Llama 3 405B) run Megatron's schedule itself (``Layout.keep_residuals``); their
table also shows the same layouts as ``sk.pipeline`` runs them, whose peaks
``bench/llama3_compile.py`` checks against XLA:GPU compiles for H100s.

    python bench/published.py            # the three tables, summaries, JSON (~2 s)
    python bench/published.py --fit      # + refit Efficiency.matmul on the calibration rows
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


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "published.json"))
    p.add_argument("--fit", action="store_true",
                   help="refit each chip's Efficiency.matmul on its calibration rows marked fit")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


from shardkit import cost  # noqa: E402
from shardkit.cost.analytic import steptime  # noqa: E402

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
    "llama3_24": "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4 (405B pre-training "
                 "on H100 80 GB: GPUs, TP, CP, PP, DP, sequence, batch per DP, tokens per batch, TFLOPs/GPU)",
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
    "llama3_24": "the paper gives TFLOPs/GPU and BF16 MFU (430 = 43% of 989) but not its formula: taken "
                 "as model() here, 6 x matmul weights + causal attention 6·L·h·s, per token",
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published training run, as published.

    Attributes:
        key: short name.
        source: a key of ``SOURCES`` (paper/report and table).
        role: ``"calibration"`` (the current constants were set from it), ``"validation"``, or
            ``"scale"`` (validation at ≥ 4,096 GPUs and ≥ 8K tokens, summarised apart).
        hardware: the ``sk.cost`` hardware entry it ran on.
        gpus: GPUs as published (``check`` compares TP x PP x DP x FSDP with it).
        params_b: model size as published, billions (``check`` compares the dims' count).
        arch: ``"gpt"`` (GELU MLP of 4h, 2 matrices; Megatron's GPT) or ``"llama"`` (SwiGLU, 3
            matrices, RoPE, RMS norm, grouped-query attention).
        d_model, layers, heads, kv_heads, d_ff, vocab, seq: model dims and sequence length.
        tie: input embedding shared with the output head.
        positions: learned position-embedding rows (Megatron-2021 GPT: ``seq``).
        global_batch: sequences per step.
        tensor, pipe, data, fsdp: parallel degrees (``data`` across replicas, ``fsdp`` sharding).
        context: context-parallel degree (the sequence split; it does not split the batch).
        layer_slots: layers as the pipeline's stages hold them, where the published run pads
            (0: ``layers``).
        keep_residuals: the pipeline runs as Megatron-LM runs 1F1B / interleaved 1F1B (every
            in-flight microbatch keeps its residuals, no recomputed forward, sharded weights
            gathered once per step): ``Layout.keep_residuals``. Without it a pipelined row is
            mapped onto ``sk.pipeline``'s GPipe/circular, whose bubble is the same.
        activations: ``ModelShape.activations`` (how the saved activations are counted).
        microbatch: sequences per microbatch and replica.
        virtual: interleaved-1F1B model chunks per stage (1: plain 1F1B, or no pipeline).
        recompute: ``"full"``, ``"selective"`` (Korthikanti's: attention core only) or ``"none"``
            (``"op-sac"``: torchtitan's per-op selective checkpointing).
        zero: ZeRO stage whose traffic the framework's optimizer has (Megatron's distributed
            optimizer reduce-scatters gradients and gathers parameters: 2).
        sequence_parallel: Megatron sequence parallelism.
        flash: a FlashAttention-style kernel: skips masked blocks (executed attention flops
            halved) and keeps the scores on chip.
        dropout: dropout on residual branches and attention probabilities (Megatron's GPT, 0.1).
        value, unit: the published figure: ``"tflops/gpu"``, ``"tokens/s/gpu"`` or ``"s/step"``.
        aggregate_pflops: the published whole-job PFLOP/s, where the table has it (a check on
            the transcription of ``value`` and ``gpus``).
        fit: for a calibration row, whether the refit uses it (``note``/``PIPELINE_NOTE`` say
            why not); ignored on validation rows.
        note: assumptions and mapping choices.
    """

    key: str
    source: str
    role: str
    hardware: str
    gpus: int
    params_b: float
    arch: str
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    global_batch: int
    tensor: int
    pipe: int
    data: int
    fsdp: int
    microbatch: int
    virtual: int
    recompute: str
    value: float
    unit: str
    tie: bool = False
    positions: int = 0
    zero: int = 0
    sequence_parallel: bool = False
    flash: bool = False
    dropout: bool = False
    aggregate_pflops: float = 0.0
    fit: bool = True
    note: str = ""
    context: int = 1
    layer_slots: int = 0
    keep_residuals: bool = False
    activations: str = "korthikanti"

    @property
    def devices(self) -> int:
        return self.tensor * self.pipe * self.data * self.fsdp * self.context

    @property
    def microbatches(self) -> int:
        """Microbatches per replica and step (gradient accumulation or pipeline)."""
        return self.global_batch // (self.data * self.fsdp * self.microbatch)


def _megatron21(key, params_b, h, l, a, t, p, gpus, batch, mbs, v, tflops, pflops,
                role="validation"):
    # Megatron's GPT: GELU MLP of 4h, learned positions, tied embedding, dropout 0.1; fp16.
    chunks = f", interleaved 1F1B, {l // p // v} layers per virtual stage" if v > 1 else (
        ", 1F1B" if p > 1 else "")
    return Run(f"megatron21-{key}", "megatron21", role, "a100", gpus, params_b, "gpt", h, l, a, a,
               4 * h, 51200, 2048, batch, t, p, gpus // (t * p), 1, mbs, v, "full", tflops,
               "tflops/gpu", tie=True, positions=2048, dropout=True, aggregate_pflops=pflops,
               fit=p == 1, note=f"fp16, full recompute (--recompute-method uniform){chunks}")


def _korthikanti(key, params_b, h, l, a, p, gpus, batch, mbs, v, seconds, selective):
    mode = "seqsel" if selective else "full"
    return Run(f"korthikanti22-{key}-{mode}", "korthikanti22", "validation", "a100", gpus,
               params_b, "gpt", h, l, a, a, 4 * h, 51200, 2048, batch, 8, p, gpus // (8 * p), 1,
               mbs, v, "selective" if selective else "full", seconds, "s/step", tie=True,
               positions=2048, sequence_parallel=selective, dropout=True,
               note="sequence parallelism + selective recompute (attention core recomputed: "
                    "~2-3% flops, not modelled)" if selective else "full recompute, no SP")


def _mcore24(key, params_b, a, h, l, t, p, d, gpus, batch, tflops, pflops):
    # Untied embedding (the published sizes count two V x h tables), flash attention (TE).
    return Run(f"mcore24-{key}", "mcore24", "calibration", "h100", gpus, params_b, "gpt", h, l, a,
               a, 4 * h, 131072, 4096, batch, t, p, d, 1, 1, 1, "none", tflops, "tflops/gpu",
               zero=2, sequence_parallel=t > 1, flash=True, aggregate_pflops=pflops, fit=p == 1,
               note="distributed optimizer, overlapped DP/TP comms; microbatch, interleaving and "
                    "recompute not published (assumed 1, none, none)"
                    + ("; pipelined: not fitted (microbatches and chunks unknown)" if p > 1 else ""))


PIPELINE_NOTE = (
    "Pipelined calibration rows are not fitted: the formulas count sk.pipeline's pipeline traffic "
    "(f32 activations, every tensor rank sending the whole activation, the m outputs psummed "
    "over the pipe axis), 30-60x the time of Megatron's sends here (16-bit activations scattered "
    "over the tensor ranks, Narayanan et al. 2021 sec. 4.1; the loss on the last stage); fitting the "
    "matmul efficiency to them would absorb that traffic into it.")


def _maxtext(nodes, tflops):
    return Run(f"maxtext24-llama2-7b-{nodes}node", "maxtext24", "validation", "h100-a3", 8 * nodes,
               6.74, "llama", 4096, 32, 32, 32, 11008, 32000, 4096, 4 * 8 * nodes, 1, 1, nodes, 8,
               4, 1, "none", tflops, "tflops/gpu", flash=True,
               note="ici_fsdp=8, dcn_data=nodes, per_device_batch 4, remat minimal_flash (saves "
                    "the matmuls), cudnn flash attention; A3 High VMs (GPUDirect-TCPX)")


def _torchtitan(gpus, tps, compiled):
    return Run(f"torchtitan24-llama3.1-8b-{gpus}gpu-{'compile' if compiled else 'eager'}",
               "torchtitan24", "calibration", "h100", gpus, 8.03, "llama", 4096, 32, 32, 8, 14336,
               128256, 8192, 2 * gpus, 1, 1, 1, gpus, 2, 1, "op-sac", tps, "tokens/s/gpu", zero=3,
               flash=True, fit=False,
               note="FSDP2, local batch 2, selective (per-op) checkpointing; H100 96 GB HBM2e at "
                    "500 W whose peak lies between the SXM and NVL figures (the source): shown, "
                    "not fitted against the 989 TFLOP/s SXM peak")


def _llama3(gpus, cp, dp, seq, tflops):
    # Sec. 3.3.2 of the paper: interleaved schedule with V stages per rank, the first and last
    # stage one layer fewer and "the first model chunk on the first stage has only the embedding":
    # chunks of one layer, so 128 slots / 16 stages = V 8. FSDP shards the optimizer state and
    # gradients and does not reshard the weights after the forward: ZeRO-3 storage, gathered once
    # per step and kept (Layout.keep_residuals). "Without activation checkpointing" at 8K.
    return Run(f"llama3-405b-{seq // 1024}k-{gpus}gpu", "llama3_24", "scale", "h100", gpus, 405, "llama",
               16384, 126, 128, 8, 53248, 128256, seq, 16 * 2**20 // seq, 8, 16, dp, 1, 1, 8, "none", tflops,
               "tflops/gpu", zero=3, flash=True, context=cp, layer_slots=128, sequence_parallel=True,
               keep_residuals=True, activations="xla",
               note="Table 4 row; 16M tokens per batch, microbatch 1 (batch per DP = microbatches); "
                    "interleaved 1F1B, v 8 (one layer per chunk: sec. 3.3.2), residuals kept (no "
                    "recompute: sec. 3.3.2, stated for 8K, taken for 128K too); FSDP: ZeRO-3, one gather per "
                    "step; sequence parallelism not stated (assumed: without it 8K could not fit); "
                    "activations counted as XLA keeps them (ModelShape.activations='xla'); CP16 at 128K "
                    "(all-gather K/V in the paper, the ring here)")


RUNS: tuple[Run, ...] = (
    # Narayanan et al. 2021, Table 1 (A100 80 GB, Selene: 8 GPUs per node, 8 x 200 Gb/s HDR IB):
    # size, hidden, layers, heads, TP, PP, GPUs, batch, microbatch and chunks (the artifact),
    # TFLOP/s per GPU, aggregate PFLOP/s.
    _megatron21("1.7b", 1.7, 2304, 24, 24, 1, 1, 32, 512, 16, 1, 137, 4.4),
    _megatron21("3.6b", 3.6, 3072, 30, 32, 2, 1, 64, 512, 16, 1, 138, 8.8),
    _megatron21("7.5b", 7.5, 4096, 36, 32, 4, 1, 128, 512, 16, 1, 142, 18.2),
    _megatron21("18.4b", 18.4, 6144, 40, 48, 8, 1, 256, 1024, 8, 1, 135, 34.6),
    _megatron21("39.1b", 39.1, 8192, 48, 64, 8, 2, 512, 1536, 4, 1, 138, 70.8),
    _megatron21("76.1b", 76.1, 10240, 60, 80, 8, 4, 1024, 1792, 2, 3, 140, 143.8),
    _megatron21("145.6b", 145.6, 12288, 80, 96, 8, 8, 1536, 2304, 2, 2, 148, 227.1),
    _megatron21("310.1b", 310.1, 16384, 96, 128, 8, 16, 1920, 2160, 1, 2, 155, 297.4),
    _megatron21("529.6b", 529.6, 20480, 105, 128, 8, 35, 2520, 2520, 1, 3, 163, 410.2),
    # The A100 constant was set from this row (52% of peak); pipelined, so not refitted (see
    # ``PIPELINE_NOTE``).
    _megatron21("1t", 1008.0, 25600, 128, 160, 8, 64, 3072, 3072, 1, 1, 163, 502.0,
                role="calibration"),
    # Korthikanti et al. 2022, A100 80 GB (Selene), s = 2048, V = 51,200, TP 8: full recompute,
    # then sequence parallelism + selective recompute.
    *(_korthikanti(k, n, h, l, a, p, g, b, mb, v, times[sel], sel) for sel in (False, True)
      for k, n, h, l, a, p, g, b, mb, v, times in (
          ("22b", 22.0, 6144, 48, 64, 1, 8, 4, 4, 1, (1.42, 1.10)),
          ("175b", 175.0, 12288, 96, 96, 8, 64, 64, 1, 3, (18.13, 13.75)),
          ("530b", 530.0, 20480, 105, 128, 35, 280, 280, 1, 3, (49.05, 37.83)),
          ("1t", 1000.0, 25600, 128, 160, 64, 512, 512, 1, 1, (94.42, 71.49)))),
    # Megatron-Core on H100 (2024), V = 131,072, s = 4096: size, heads, hidden, layers, TP, PP,
    # DP, GPUs, batch, TFLOP/s per GPU, aggregate PFLOP/s.
    _mcore24("1.7b", 1.7, 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 19.6),
    _mcore24("7.1b", 7.1, 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 44.7),
    _mcore24("16b", 16, 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 93.9),
    _mcore24("32b", 32, 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 176.5),
    _mcore24("70b", 70, 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 322.3),
    _mcore24("119b", 119, 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 645.9),
    _mcore24("177b", 177, 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 997.2),
    _mcore24("314b", 314, 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 1457.4),
    _mcore24("462b", 462, 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 2825.6),
    # torchtitan, Llama 3.1 8B, bf16 rows only (Float8 rows use another peak).
    _torchtitan(8, 5762, False), _torchtitan(8, 6667, True),
    _torchtitan(128, 5605, False), _torchtitan(128, 6514, True),
    # MaxText Llama2-7B on A3 (8 x H100 80 GB per VM).
    _maxtext(1, 492), _maxtext(2, 422), _maxtext(4, 407), _maxtext(8, 409), _maxtext(16, 375),
    # Llama 3 405B (Table 4): 8K-token pre-training on 8,192 and 16,384 H100s, and the 128K-context
    # phase with context parallelism 16. Kept apart from calibration and validation ("scale").
    _llama3(8192, 1, 64, 8192, 430), _llama3(16384, 1, 128, 8192, 400), _llama3(16384, 16, 8, 131072, 380),
)


def check(run: Run) -> list[str]:
    """What is inconsistent in a row's configuration (empty when nothing is)."""
    bad = []
    if run.role not in ("calibration", "validation", "scale"):
        bad.append(f"role {run.role!r}")
    if run.d_model % run.heads or run.heads % run.kv_heads:
        bad.append(f"d_model {run.d_model} / heads {run.heads} / kv_heads {run.kv_heads}")
    if run.global_batch % (run.data * run.fsdp * run.microbatch):
        bad.append(f"global batch {run.global_batch} over {run.data * run.fsdp} replicas x "
                   f"microbatch {run.microbatch}")
    if (run.layer_slots or run.layers) % (run.pipe * run.virtual):
        bad.append(f"{run.layer_slots or run.layers} layers over pipe {run.pipe} x {run.virtual} chunks")
    if run.pipe > 1 and run.virtual > 1 and run.microbatches % run.pipe:
        bad.append(f"interleaved schedule needs microbatches ({run.microbatches}) divisible by "
                   f"pipe ({run.pipe})")
    if run.heads % run.tensor:
        bad.append(f"heads {run.heads} over tensor {run.tensor}")
    if run.devices != run.gpus:
        bad.append(f"TP x PP x DP x FSDP x CP = {run.devices} != {run.gpus} GPUs")
    if abs(model(run).params / 1e9 / run.params_b - 1) > 0.03:
        bad.append(f"{model(run).params / 1e9:.1f}B parameters from the dims, published "
                   f"{run.params_b}B")
    if run.aggregate_pflops and abs(run.value * run.gpus / 1e3 / run.aggregate_pflops - 1) > 0.01:
        bad.append(f"{run.value} TFLOP/s x {run.gpus} GPUs != {run.aggregate_pflops} PFLOP/s")
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
                               tie=run.tie, gated=False, flash_attention=run.flash, dropout=run.dropout)
    cfg = types.SimpleNamespace(d_model=h, layers=l, heads=run.heads, kv_heads=run.kv_heads,
                                d_ff=run.d_ff, vocab=V, seq=s, tie=run.tie, head_dim=None)
    ms = cost.model_shape(cfg)
    return dataclasses.replace(ms, name=run.key, flash_attention=run.flash, dropout=run.dropout,
                               flops_per_token=ms.flops_per_token - 12.0 * l * h * s + attention,
                               activations=run.activations)


def layout(run: Run) -> cost.Layout:
    """The closest ``Layout``: a row marked ``keep_residuals`` is Megatron's (interleaved) 1F1B
    itself (``Layout.keep_residuals``: its in-flight residuals, no recompute); the others map
    Megatron's interleaved 1F1B with v chunks onto ``"circular"`` with ``repeats=v`` (same
    bubble (p − 1)/(v·m), Narayanan et al. 2021) and plain 1F1B onto ``"gpipe"`` (same bubble;
    ``sk.pipeline``'s ``"1f1b"`` recomputes each stage's forward, which Megatron does not).
    Without a pipeline Megatron, MaxText and torchtitan reduce gradients once per step, so the
    layout has one microbatch (``Layout.microbatches`` would reduce per microbatch).
    Torchtitan's per-op selective checkpointing (every other matmul recomputed) is
    ``remat="dots"``; Korthikanti's selective recompute (attention core only, ~2-3% flops) is
    ``"none"``."""
    remat = {"full": "full", "op-sac": "dots"}.get(run.recompute, "none")
    piped = run.pipe > 1
    if run.keep_residuals:
        schedule = "interleaved-1f1b" if run.virtual > 1 else "1f1b"
    else:
        schedule = "circular" if piped and run.virtual > 1 else "gpipe"
    return cost.Layout(data=run.data, fsdp=run.fsdp, tensor=run.tensor, pipe=run.pipe,
                       zero=run.zero, microbatches=run.microbatches if piped else 1,
                       schedule=schedule, repeats=run.virtual if piped else 1, remat=remat,
                       sequence_parallel=run.sequence_parallel, context=run.context,
                       keep_residuals=run.keep_residuals and piped)


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
    if run.source == "llama3_24":
        return model(run).flops_per_token * s * B
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


def evaluate(run: Run, memory: bool = True, **estimate_kw) -> dict:
    """The estimate of one run next to its published figure. ``memory`` adds the non-matmul
    kernels' time (``steptime.memory_bound_time``) to compute; ``False`` shows the estimate
    without it."""
    kw = dict(global_batch=run.global_batch, precision="bf16", **estimate_kw)
    ms, lo = model(run), layout(run)
    est = cost.estimate(ms, lo, run.hardware, memory_bound=memory, **kw)
    extra = est.time["memory-bound"]
    published = published_seconds(run)
    t = est.time
    extra_cols = {}
    if run.keep_residuals:
        # The same layout as sk.pipeline runs it (stage inputs kept, forward recomputed in the
        # backward op): what shardkit itself would compile (bench/llama3_compile.py).
        sk_lo = dataclasses.replace(lo, keep_residuals=False)
        sk_est = cost.estimate(ms, sk_lo, run.hardware, memory_bound=memory, **kw)
        extra_cols = {"sk_pipeline_peak_gib": sk_est.memory["peak"] / 2**30,
                      "sk_pipeline_error": published / sk_est.step_time - 1.0}
    return {**extra_cols, "key": run.key, "role": run.role, "fit": run.fit and run.role == "calibration",
            "source": run.source,
            "hardware": run.hardware, "devices": run.devices, "layout": str(lo),
            "pipelined": run.pipe > 1, "unit": run.unit, "published": run.value,
            "estimated": in_source_unit(run, est.step_time),
            "error": published / est.step_time - 1.0,
            "published_s": published, "estimated_s": est.step_time, "memory_s": extra,
            "compute_s": t["compute"], "bubble_s": t["bubble"], "exposed_s": t["exposed"],
            "pipe_s": sum(t[k] for k in ("pipe-permute", "pipe-reduce", "pipe-relayout")),
            "peak_gib": est.memory["peak"] / 2**30, "note": run.note}


def megatron_p2p_seconds(run: Run, estimated: dict) -> float:
    """Diagnostic, not the model: the step time if the pipeline sent what Megatron sends instead
    of what the formulas count for ``sk.pipeline``. Per microbatch and model chunk, one
    activation forward and one gradient backward across each stage boundary, 16-bit, scattered
    over the t tensor ranks (Narayanan et al. 2021, sec. 4.1 "scatter/gather"; interleaving sends
    v times as many, sec. 2.2.2), over the inter-node links (every pipe boundary here crosses
    nodes). Pipeline traffic enters ``steptime.times``'s step linearly (``exposed_pipe`` of it),
    so it is swapped in place."""
    if run.pipe == 1 or run.keep_residuals:  # the latter's model already sends Megatron's traffic
        return estimated["estimated_s"]
    hw = cost.hardware.lookup(run.hardware)
    eff = cost.efficiency_for(hw)
    messages = 2 * run.virtual * run.microbatches
    nbytes = run.microbatch * run.seq / run.context * run.d_model * 2 / run.tensor
    node, _, inter_latency = steptime.links(hw)
    if run.data * run.fsdp * run.tensor < node:
        raise ValueError(f"{run.key}: the diagnostic assumes pipe neighbours on different nodes")
    p2p = messages * (steptime.collective_time("permute", nbytes, 2, hw.inter_node_bw, inter_latency)
                      + eff.latency)
    return estimated["estimated_s"] + eff.exposed_pipe * (p2p - estimated["pipe_s"])


def fit_matmul(hardware: str, runs=RUNS, lo: float = 0.2, hi: float = 1.0) -> tuple[float, int]:
    """The ``Efficiency.matmul`` of ``hardware`` that minimises the mean squared log error of
    step time over its calibration rows marked ``fit`` (the memory-bound term on), and how many
    rows there were. Golden-section search: the error is monotone in the constant per row, so
    the squared log error is unimodal."""
    rows = [r for r in runs if r.role == "calibration" and r.fit and r.hardware == hardware]
    if not rows:
        raise ValueError(f"no calibration rows to fit for {hardware!r}")
    base = cost.EFFICIENCY[hardware]

    def loss(x: float) -> float:
        m = dataclasses.replace(base, matmul=x)
        return sum(math.log1p(evaluate(r, model_efficiency=m)["error"]) ** 2 for r in rows)

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(60):
        c, d = b - g * (b - a), a + g * (b - a)
        if loss(c) < loss(d):
            b = d
        else:
            a = c
    return (a + b) / 2, len(rows)


def summary(rows: list[dict], key: str = "error") -> dict:
    """Mean and max |error|, the bias (mean error) and the count within ±15% of a set of rows."""
    errs = [r[key] for r in rows]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "mean_abs": sum(map(abs, errs)) / len(errs),
            "max_abs": max(map(abs, errs)), "bias": sum(errs) / len(errs),
            "within_15pct": sum(abs(e) <= 0.15 for e in errs)}


def results(runs=RUNS) -> dict:
    """Every row evaluated (memory-bound term on), with the two comparisons beside it: the
    estimate without the memory-bound term (what ``sk.cost.estimate`` gives by default today)
    and the Megatron-p2p diagnostic; and the summaries per role and subset."""
    bad = {r.key: check(r) for r in runs if check(r)}
    if bad:
        raise ValueError(f"inconsistent rows: {bad}")
    rows = []
    for run in runs:
        row = evaluate(run)
        row["error_default"] = evaluate(run, memory=False)["error"]
        row["error_p2p"] = row["published_s"] / megatron_p2p_seconds(run, row) - 1.0
        rows.append(row)
    out = {"rows": rows, "summary": {}}
    for role in ("calibration", "validation", "scale"):
        sel = [r for r in rows if r["role"] == role]
        out["summary"][role] = {
            "all": summary(sel), "default": summary(sel, "error_default"),
            "unpipelined": summary([r for r in sel if not r["pipelined"]]),
            "pipelined": summary([r for r in sel if r["pipelined"]]),
            "pipelined_p2p": summary([r for r in sel if r["pipelined"]], "error_p2p"),
            "fitted": summary([r for r in sel if r["fit"]]) if role == "calibration" else None}
    return out


def config(run: Run) -> str:
    """The published configuration in a few characters: degrees, pipeline schedule, recompute."""
    axes = " ".join(f"{n}{getattr(run, a)}" for n, a in (("t", "tensor"), ("c", "context"), ("p", "pipe"),
                                                          ("d", "data"), ("fsdp", "fsdp")) if getattr(run, a) > 1)
    pipe = (f" 1F1B{f' v{run.virtual}' if run.virtual > 1 else ''} m{run.microbatches}"
            if run.pipe > 1 else "")
    return f"{axes or 'd1'}{pipe} {run.recompute}{' sp' if run.sequence_parallel else ''}"


def _line(name: str, s: dict) -> str:
    if not s or not s.get("n"):
        return f"  {name}: -"
    return (f"  {name}: n={s['n']}  mean |error| {s['mean_abs']:.1%}  max |error| {s['max_abs']:.1%}"
            f"  bias {s['bias']:+.1%}  within ±15%: {s['within_15pct']}/{s['n']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    out = results()
    out.update(sources=SOURCES, conventions=CONVENTIONS, pipeline_note=PIPELINE_NOTE)
    for role in ("calibration", "validation", "scale"):
        sel = [r for r in out["rows"] if r["role"] == role]
        table = Table(title=f"{role} ({len(sel)} runs): sk.cost.estimate + memory_bound_time vs published"
                      + (" (validation at >= 4,096 GPUs, >= 8K tokens; summarised apart)" if role == "scale" else ""))
        cols = ["run", "hw", "GPUs", "config", "unit", "published", "estimated", "error",
                "no mem. term", "mem/compute", "pipe/step", "Megatron p2p (diag.)", "peak GiB"]
        if role == "scale":
            cols += ["sk.pipeline: error", "peak GiB"]
        for c in cols:
            table.add_column(c, justify="left" if c in ("run", "hw", "config", "unit") else "right")
        runs = {r.key: r for r in RUNS}
        for r in sel:
            fmt = ("{:.2f}" if r["unit"] == "s/step" else "{:,.0f}" if r["unit"] == "tokens/s/gpu"
                   else "{:.1f}")
            mark = "" if role != "calibration" else " (fit)" if r["fit"] else " *"
            cells = [r["key"] + mark, r["hardware"], str(r["devices"]), config(runs[r["key"]]), r["unit"],
                     fmt.format(r["published"]), fmt.format(r["estimated"]), f"{r['error']:+.1%}",
                     f"{r['error_default']:+.1%}", f"{r['memory_s'] / r['compute_s']:.0%}",
                     f"{r['pipe_s'] / r['estimated_s']:.0%}",
                     f"{r['error_p2p']:+.1%}" if r["pipelined"] else "", f"{r['peak_gib']:.0f}"]
            if role == "scale":
                cells += [f"{r['sk_pipeline_error']:+.1%}", f"{r['sk_pipeline_peak_gib']:.0f}"]
            table.add_row(*cells)
        console.print(table)
        s = out["summary"][role]
        console.print(f"{role}:")
        for name in ("all", "default", "unpipelined", "pipelined", "pipelined_p2p", "fitted"):
            if s.get(name):
                console.print(_line(name, s[name]))
    console.print("* calibration rows shown, not fitted (see their note). error = estimated/published"
                  " throughput - 1; 'no mem. term' = sk.cost.estimate(..., memory_bound=False); 'Megatron p2p' = the "
                  "pipeline sending what Megatron sends (a diagnostic, not the model)")
    if args.fit:
        for chip in sorted({r.hardware for r in RUNS if r.role == "calibration" and r.fit}):
            value, n = fit_matmul(chip)
            console.print(f"refit {chip}: matmul {value:.3f} on {n} calibration rows "
                          f"(steptime.EFFICIENCY has {cost.EFFICIENCY[chip].matmul:.3f})")
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    console.print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
