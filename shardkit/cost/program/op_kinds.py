"""How the program reader (``program``) classifies jaxpr primitives: which XLA fuses into
their consumers, which are views, slices, matmuls, reductions, opaque kernels and collectives.
One table, read by ``program`` and ``cpu_buffers``'s rules, and how a view maps its operand's dims."""

import math

# Ops XLA fuses into their consumers (loop fusion): elementwise math, casts, broadcasts and
# layout changes. Everything else materialises its result.
FUSIBLE = {
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log", "log1p",
    "expm1", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "pow", "integer_pow", "square", "erf",
    "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "floor", "ceil", "round", "is_finite",
    "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
    "copy", "copy_p", "stop_gradient", "nextafter", "rem", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "imag", "real", "conj", "reduce_precision",
    "sharding_constraint", "pvary", "pcast", "iota",
}
# Elementwise ops XLA will not duplicate into several consumers (``IsExpensive``): with more
# than one consumer their result is materialised once (a GELU's tanh, read by the forward
# and by the backward).
EXPENSIVE = {"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "rsqrt", "sqrt", "cbrt",
              "pow", "erf", "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "div", "rem"}
# Reductions fuse their (elementwise) inputs, then materialise their (smaller) result.
REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
           "argmax", "argmin"}
# Ops whose result is one of their inputs seen differently (no bytes of their own).
VIEW = {"reshape", "squeeze", "expand_dims", "convert_element_type", "sharding_constraint",
         "pvary", "pcast", "copy", "copy_p", "transpose", "broadcast_in_dim"}
MATMUL = {"dot_general", "conv_general_dilated"}
# Ops that take part of a value (a stacked weight's one slice: ``w[:, i]``): a use of the
# parameter for the readings, a value of its own for sizes.
SLICE = {"slice", "dynamic_slice", "index_in_dim", "rev"}


def whole_slice(e) -> bool:
    """Whether ``e`` is a slice that takes all of its operand (``w[rep]`` of a stack of one
    chunk): a view of it, not a value of its own. (``rev`` reorders its operand: a value.)"""
    return (e.primitive.name in SLICE and e.primitive.name != "rev"
            and math.prod(e.outvars[0].aval.shape) == math.prod(e.invars[0].aval.shape))


# Primitives whose body the reader cannot see (a kernel written for one backend): their flops
# and buffers are not counted (``ProgramReading.unseen``).
OPAQUE = {"pallas_call", "ffi_call", "custom_call", "triton_kernel_call", "mosaic_gpu_call", "tpu_custom_call"}
# jaxpr collectives -> the HLO collective they become (``hlo.Traffic.kind``).
COLLECTIVES = {"ppermute": "collective-permute", "all_to_all": "all-to-all", "ragged_all_to_all": "all-to-all",
               "all_gather": "all-gather", "psum": "all-reduce", "psum_invariant": "all-reduce",
               "reduce_scatter": "reduce-scatter"}


def view_dims(e, dims: frozenset) -> frozenset | None:
    """The split dims of a view's (or slice's) result, given its operand's; None where they are
    not followed. ``program`` carries a weight's tensor-split dims to its uses with it."""
    name = e.primitive.name
    if name == "transpose":
        perm = e.params["permutation"]
        return frozenset(i for i, j in enumerate(perm) if j in dims)
    if name == "broadcast_in_dim":
        return frozenset(e.params["broadcast_dimensions"][d] for d in dims)
    if name == "squeeze":
        gone = {d % e.invars[0].aval.ndim for d in e.params["dimensions"]}
        keep = [d for d in range(e.invars[0].aval.ndim) if d not in gone]
        return frozenset(keep.index(d) for d in dims if d in keep)
    if name == "reshape":
        # A split dim lands on the result dim that holds its outermost factor (row-major).
        src, out = e.invars[0].aval.shape, e.outvars[0].aval.shape
        got = set()
        for d in dims:
            start = math.prod(src[:d])
            acc = 1
            for i, n in enumerate(out):
                if acc <= start < acc * n:
                    got.add(i)
                    break
                acc *= n
        return frozenset(got)
    if name in SLICE or name in VIEW:  # casts, constraints, slices: the same dims
        return dims if e.outvars[0].aval.ndim == e.invars[0].aval.ndim else None
    return None
