"""The matmul flops a compiled program executes, read off its HLO text through loop trip
counts: ``dot``, ``convolution``, cuDNN convolutions, XLA:TPU's grouped ``ragged-dot`` and
``sk.attention``'s flash kernel calls (``matmul_flops_from_hlo``), and how many matmuls XLA
rewrote as elementwise multiplies (``rewritten_matmuls``), whose flops no ``dot`` is left to show.
"""

from __future__ import annotations

import math
import re

from ...flash_flops import flash_call_flops, flash_kernel
from .text import _INSTR, _NAMED, _OP_NAME, _SHAPE, HloParseError, _ints, _split_tuple, _walk

_DOT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+dot\(\s*(?:(\S+\[[0-9,]*\])\S*\s+)?%?([\w.\-]+)")
_LHS_C = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_CONV = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+convolution\(\s*%?([\w.\-]+)\S*,\s*%?([\w.\-]+)")
# XLA:GPU lowers convolutions to cuDNN custom calls: forward (x, w) -> y, backward input
# (dy, w) -> dx, backward filter (x, dy) -> dw, each with the forward convolution's dim_labels.
_CUDNN = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\(?(\S+?\])\S*\s"
                    r".*?custom-call\(\s*%?([\w.\-]+)\S*,\s*%?([\w.\-]+)"
                    r".*custom_call_target=\"__cudnn\$conv(\w+)\"")
# XLA:TPU's lax.ragged_dot (forward and input gradient): a Mosaic grouped matmul it names
# ragged-dot-*, whose flops it writes in its backend config (the rows it is handed times one
# group's weights; ragged-dot-metadata is the group bookkeeping).
_TPU_RAGGED_DOT = re.compile(r'^\s*(?:ROOT\s+)?%ragged-dot-(?!metadata)[\w.\-]*\s*=.*custom_call_target="tpu_custom_call"'
                             r'.*"cost_estimate":\{"flops":"(\d+)"')
# sk.attention's Pallas flash kernels: custom calls no compiler counts flops for (Triton's on
# GPU, Mosaic's on TPU), told apart from other kernels by the named scope in their metadata.
_KERNEL_CALL = re.compile(r'custom_call_target="(?:__gpu\$xla\.gpu\.triton|tpu_custom_call)"')
_WINDOW = re.compile(r"window=\{size=([0-9x]+)")
_LHS_DILATE = re.compile(r"window=\{[^}]*lhs_dilate=([0-9x]+)")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->")


def matmul_flops_from_hlo(hlo: str, branch_weights: dict[int, list[float]] | None = None,
                          fp8_only: bool = False) -> float:
    """Flops of every ``dot`` (2 × result elements × contracted size), ``convolution`` (2 ×
    result elements × window × input features per group), XLA:TPU ``ragged-dot`` grouped
    matmul (the flops its kernel's cost estimate states) and ``sk.attention`` flash kernel call
    (``_flash_flops``: the program reader's formula), counted through loop trip counts — XLA's
    ``cost_analysis`` counts a ``while`` body once and no custom call. ``branch_weights``
    weights ``conditional`` branches as in ``_walk`` (a pipeline's schedule table: a 1F1B tick
    runs one of its switch's branches, not all of them). ``fp8_only``: only the ops (dots,
    convolutions, cuDNN convolutions alike) whose operands are all fp8 (``f8e4m3fn``,
    ``f8e5m2``, ...: ``sk.fp8``'s GEMMs); XLA:TPU writes a bf16 dot as a ``convolution``, which
    is no fp8 GEMM."""
    comps, mult = _walk(hlo, branch_weights)
    total = 0.0
    for name, lines in comps.items():
        m = mult.get(name, 0)
        if not m:
            continue
        shapes = defined_types(lines)
        total += m * sum(line_matmul_flops(line, shapes, fp8_only) for line in lines)
    return total


def defined_types(lines: list[str]) -> dict[str, str]:
    """Instruction name -> the type it defines, for one computation's lines."""
    return {d.group(1): d.group(2) for d in map(_NAMED.match, lines) if d is not None}


def line_matmul_flops(line: str, shapes: dict, fp8_only: bool = False) -> float:
    """The flops of one HLO instruction (``matmul_flops_from_hlo``'s rules; 0 for an op that is
    no matmul, convolution or flash kernel). ``shapes``: ``defined_types`` of its computation."""
    if (g := _TPU_RAGGED_DOT.match(line)) is not None:
        return 0.0 if fp8_only else float(g.group(1))
    if (flash := _flash_flops(line, shapes)) is not None:
        return 0.0 if fp8_only else flash
    cv = _CONV.match(line)
    cd = _CUDNN.match(line) if cv is None and "__cudnn$conv" in line else None
    d = _DOT.match(line) if cv is None and cd is None else None
    if (cv or cd or d) is None or (fp8_only and not _fp8_operands(line, shapes)):
        return 0.0
    if cv is not None:
        return _conv_flops(line, cv, shapes)
    if cd is not None:
        return _cudnn_conv_flops(line, cd, shapes)
    lhs = d.group(2) or shapes.get(d.group(3), "")
    lhs_dims = _ints(lhs.split("[", 1)[1].split("]", 1)[0]) if "[" in lhs else []
    res = _ints(d.group(1).split("[", 1)[1].split("]", 1)[0]) if "[" in d.group(1) else []
    c = _LHS_C.search(line)
    k = math.prod(lhs_dims[i] for i in _ints(c.group(1)) if i < len(lhs_dims)) if c else 1
    return 2.0 * math.prod(res) * k


def _flash_flops(line: str, shapes: dict) -> float | None:
    """The flops of an ``sk.attention`` flash kernel call (``cost.flash_flops``, the program
    reader's formula, on the custom call's operand and result shapes), or None where ``line``
    is no kernel call inside a flash scope.

    Raises:
        HloParseError: an operand's shape cannot be read (a figure without it would be wrong).
    """
    if "custom-call(" not in line or not _KERNEL_CALL.search(line):
        return None
    op_name = _OP_NAME.search(line)
    found = flash_kernel(op_name.group(1)) if op_name else None
    if found is None:
        return None
    array = lambda t: (_ints(t.group(2)), t.group(1) in _FLOAT or bool(_FP8.match(t.group(1))))  # noqa: E731
    operands = [_SHAPE.search(t) for t in _operand_types(line, shapes)]
    if len(operands) < 2 or None in operands:
        raise HloParseError(f"cannot read the operand shapes of this flash kernel call: {line.strip()[:300]}")
    return flash_call_flops(*found, [array(t) for t in operands],
                            [array(t) for t in _SHAPE.finditer(_INSTR.match(line).group(1))])


_FLOAT = ("bf16", "f16", "f32", "f64")


# A floating-point array multiply (not the scalar index arithmetic of a dot's loop) named
# after a dot_general.
_REWRITTEN = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:bf16|f16|f32|f64|f8\w+)\[\d[\d,]*\]\S*\s+"
                        r"multiply\(.*op_name=\"([^\"]*dot_general)\"(?:.*stack_frame_id=(\d+))?")


def rewritten_matmuls(hlo: str) -> int:
    """How many ops of the program are matmuls XLA rewrote as an elementwise ``multiply`` (then
    a ``reduce``) — its algebraic simplifier does so for a matrix-vector or outer product —
    told apart by the ``dot_general`` they came from (op name and source frame in the
    metadata). Their flops are not in ``matmul_flops_from_hlo``: no ``dot`` is left to read.
    (A ``reduce`` alone named after a dot is XLA:GPU's split-K sum of a dot that stays one.)"""
    comps, mult = _walk(hlo)
    seen = set()
    for name, lines in comps.items():
        if mult.get(name):
            seen.update(m.groups() for m in map(_REWRITTEN.search, lines) if m is not None)
    return len(seen)


_FP8 = re.compile(r"^f8e\d")
_COMMENT = re.compile(r"/\*.*?\*/")  # HLO numbers long operand lists: /*index=5*/


def operand_words(ins) -> list[list[str]]:
    """Each operand of an instruction (an ``_INSTR`` match), in order, as its words: the type
    written before its name and the name, or the name alone."""
    text, depth, end = ins.group(3), 1, 0
    for end, ch in enumerate(text):  # the operand list ends at the op's closing parenthesis
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return [w for w in (o.split() for o in _split_tuple(f"({_COMMENT.sub('', text[:end])})")) if w]


def _operand_types(line: str, shapes: dict) -> list[str]:
    """The types of an instruction's operands, in order: the one written before an operand's
    name, or else the one its defining instruction gave it ("" where neither is known)."""
    ins = _INSTR.match(line)
    if ins is None:
        return []
    return [w[0] if len(w) > 1 else shapes.get(w[-1].lstrip("%"), "") for w in operand_words(ins)]


def _fp8_operands(line: str, shapes: dict) -> bool:
    """Whether every operand of an instruction is fp8."""
    types = [t.lstrip("(").split("[", 1)[0] for t in _operand_types(line, shapes)]
    return bool(types) and all(_FP8.match(t) for t in types)


def _conv_flops(line: str, cv, shapes: dict) -> float:
    """2 × result elements × window taps × the kernel's input-feature dimension (the ``i`` of
    its dim labels: input features per group, or the batch for a weight gradient).

    The taps per spatial dim are the window's, less those no output can meet on the input:
    a strided convolution's input gradient dilates its operand by the stride, and the inserted
    zeros are not work (as ``program``'s count and cuDNN's); and a window wider than the
    input's extent meets at most that many positions, the rest padding — XLA:TPU writes a
    dot's free dim as such a window (``btd,dhk->bthk``: ``window={size=1x8 pad=0_0x7_7}`` over
    an input of extent 1, each output meeting one tap), and the estimate counts a window over
    a smaller map at the map's extent (``program.walk._swapped_window``)."""
    res = _ints(cv.group(1).split("[", 1)[1].split("]", 1)[0]) if "[" in cv.group(1) else []
    rhs = shapes.get(cv.group(3), "")
    rhs_dims = _ints(rhs.split("[", 1)[1].split("]", 1)[0]) if "[" in rhs else []
    window, labels = _WINDOW.search(line), _DIM_LABELS.search(line)
    if not res or not rhs_dims or labels is None or "i" not in labels.group(2):
        raise HloParseError(f"cannot read this convolution's shapes: {line.strip()[:300]}")
    sizes = _ints(window.group(1).replace("x", ",")) if window else []
    dilate = _LHS_DILATE.search(line)
    dilation = _ints(dilate.group(1).replace("x", ",")) if dilate else [1] * len(sizes)
    lhs = shapes.get(cv.group(2), "")
    lhs_dims = _ints(lhs.split("[", 1)[1].split("]", 1)[0]) if "[" in lhs else []
    lhs_labels = labels.group(1)
    taps = 1.0
    for d, (k, b) in enumerate(zip(sizes, dilation)):
        at = lhs_labels.find(str(d))
        extent = lhs_dims[at] if 0 <= at < len(lhs_dims) else math.inf  # unread: the window's
        taps *= min(k / b, extent)
    return 2.0 * math.prod(res) * taps * rhs_dims[labels.group(2).index("i")]


def _cudnn_conv_flops(line: str, cd, shapes: dict) -> float:
    """A cuDNN convolution's flops: 2 × the forward output's elements × window × the kernel's
    input features, whichever of the three passes it is (the forward output is the result of
    the forward, the first operand of the input gradient, the second of the filter gradient;
    the kernel the second operand, or the filter gradient's result)."""
    dims = lambda t: _ints(t.split("[", 1)[1].split("]", 1)[0]) if "[" in t else []  # noqa: E731
    res, a, b, kind = cd.group(1), shapes.get(cd.group(2), ""), shapes.get(cd.group(3), ""), cd.group(4)
    y, kernel = {"BackwardInput": (a, b), "BackwardFilter": (b, res)}.get(kind, (res, b))
    window, labels = _WINDOW.search(line), _DIM_LABELS.search(line)
    if not dims(y) or not dims(kernel) or labels is None or "i" not in labels.group(2):
        raise HloParseError(f"cannot read this cuDNN convolution's shapes: {line.strip()[:300]}")
    size = math.prod(_ints(window.group(1).replace("x", ","))) if window else 1
    return 2.0 * math.prod(dims(y)) * size * dims(kernel)[labels.group(2).index("i")]
