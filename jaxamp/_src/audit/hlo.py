"""The compiled-HLO reader: a compiled program's matmuls, converts and sensitive operations."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from jaxamp._src.audit.checks import (
    SensitiveOp,
    combined_primitive,
    direction,
    is_cumulative,
    is_float8_gemm,
)
from jaxamp._src.dtypes import FLOAT_NAMES, hlo_dtype_name, is_narrower

_HLO_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\([^)]*\)|\S+)\s+"
    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
_HLO_OPERAND = re.compile(r"([a-zA-Z0-9]+)\[([\d,]*)\]")
_HLO_REFERENCE = re.compile(r"%([\w.\-]+)")
_HLO_ALGORITHM = re.compile(r"algorithm=dot_(\w+)|ALG_DOT_(\w+)")
_HLO_NAME = re.compile(r'op_name="([^"]*)"')
# cuBLAS and cuDNN GEMMs, convolutions, and the block-scaled GEMM (JAX's scaled_matmul,
# then cuDNN's kernel after XLA's rewrite)
_HLO_MATMUL_TARGETS = (
    "cublas",
    "cudnn$conv",
    "__cudnn$conv",
    "gemm",
    "block_scaled_dot",
    "blockScaledDot",
)
_HLO_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*->.*\{\s*$")
_HLO_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
_HLO_WINDOW = re.compile(r"window=\{([^}]*)\}")
# HLO opcode -> the JAX primitive it computes, for the numerically sensitive ones.
_HLO_ELEMENTWISE = {
    "exponential": "exp",
    "exponential-minus-one": "expm1",
    "log": "log",
    "log-plus-one": "log1p",
    "logistic": "logistic",
    "rsqrt": "rsqrt",
    "sqrt": "sqrt",
    "power": "pow",
    "tan": "tan",
    "erf": "erf",
}
# HLO opcodes that combine values with their ``to_apply`` computation -> family.
_HLO_FAMILIES = {
    "reduce": "reduce",
    "reduce-window": "reduce_window",
    "scatter": "scatter",
    "all-reduce": "all_reduce",
    "all-reduce-start": "all_reduce",
    "reduce-scatter": "reduce_scatter",
}
# Instructions of a ``to_apply`` computation that move or round values, not combine them.
_HLO_NOT_COMBINING = frozenset({"parameter", "constant", "convert", "bitcast", "copy"})


def wider_result(lhs: str, rhs: str, result: str) -> str | None:
    """The accumulation dtype a result wider than its operands states, else ``None``."""
    narrower = {lhs, result} <= FLOAT_NAMES and is_narrower(lhs, result)
    if narrower and (rhs not in FLOAT_NAMES or is_narrower(rhs, result)):
        return result
    return None


def _algorithm_accumulation(match: re.Match) -> str:
    """``dot_bf16_bf16_f32`` / ``ALG_DOT_BF16_BF16_F32_X3`` -> ``float32``."""
    parts = [
        p
        for p in next(g for g in match.groups() if g).lower().split("_")
        if not re.fullmatch(r"x\d+", p)
    ]
    return hlo_dtype_name(parts[-1])


def _hlo_operands(
    operands: str, types: dict[str, tuple[str, tuple[int, ...]]]
) -> list[tuple[str, tuple[int, ...]]]:
    """Operand ``(dtype, shape)`` pairs, from inline types or from their definitions."""
    inline = [
        (hlo_dtype_name(t), tuple(int(d) for d in dims.split(",") if d))
        for t, dims in _HLO_OPERAND.findall(operands)
    ]
    if inline:
        return inline
    return [types[name] for name in _HLO_REFERENCE.findall(operands) if name in types]


def _hlo_types(instructions: list[re.Match]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{instruction name: (dtype, shape)}`` (a tuple's first element)."""
    types = {}
    for match in instructions:
        first = _HLO_OPERAND.search(match.group("type"))
        if first:
            types[match.group("name")] = (
                hlo_dtype_name(first.group(1)),
                tuple(int(d) for d in first.group(2).split(",") if d),
            )
    return types


def _hlo_computations(text: str) -> dict[str, list[re.Match]]:
    """``{computation name: its instructions}`` of an HLO module's text."""
    computations: dict[str, list[re.Match]] = {}
    current: list[re.Match] = []
    for line in text.splitlines():
        header = _HLO_COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group("name"), [])
        elif (match := _HLO_INSTR.match(line)) is not None:
            current.append(match)
    return computations


def _hlo_name(rest: str) -> str:
    """The source name of an instruction (its ``op_name`` metadata), else ``""``."""
    match = _HLO_NAME.search(rest)
    return match.group(1) if match else ""


def _hlo_matmul(match: re.Match, operands: list, result: str) -> dict[str, Any] | None:
    """The ``MatmulOp`` fields of a ``dot``, ``convolution`` or cuBLAS/cuDNN call."""
    op, rest = match.group("op"), match.group("rest")
    is_library_call = op == "custom-call" and any(t in rest for t in _HLO_MATMUL_TARGETS)
    if (op not in ("dot", "convolution") and not is_library_call) or len(operands) < 2:
        return None
    (lhs, lhs_shape), (rhs, rhs_shape) = operands[:2]
    algorithm = _HLO_ALGORITHM.search(rest)
    accumulation = (
        _algorithm_accumulation(algorithm) if algorithm else wider_result(lhs, rhs, result)
    )
    name = _hlo_name(rest)
    return dict(
        kind=op,
        lhs_dtype=lhs,
        rhs_dtype=rhs,
        result_dtype=result,
        accumulation_dtype=accumulation,
        lhs_shape=lhs_shape,
        rhs_shape=rhs_shape,
        name=name,
        direction=direction(name),
        float8=is_float8_gemm(name, lhs, rhs),
    )


def _narrowest(dtypes: list[str]) -> str | None:
    """The narrowest floating dtype of ``dtypes`` (``None`` when there is none)."""
    floats = [d for d in dtypes if d in FLOAT_NAMES]
    if not floats:
        return None
    return functools.reduce(lambda a, b: b if is_narrower(b, a) else a, floats)


def _hlo_combiner(computation: list[re.Match], types: dict) -> tuple[str | None, str | None]:
    """``(combiner, narrowest dtype)`` of a ``to_apply`` computation.

    The combiner is its one combining instruction (``add``, ``maximum``...), ``None``
    when it has several. The dtype is the narrowest floating type its values take:
    XLA:CPU runs a bfloat16 sum in float32 but rounds each partial sum to bfloat16
    (``convert`` to bfloat16 and back), which accumulates in bfloat16.
    """
    combining = {m.group("op") for m in computation} - _HLO_NOT_COMBINING
    combiner = next(iter(combining)) if len(combining) == 1 else None
    dtypes = [types.get(m.group("name"), ("",))[0] for m in computation]
    return combiner, _narrowest(dtypes)


def _hlo_window(rest: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple]:
    """``(size, stride, padding)`` of ``window={size=1x8 stride=1x1 pad=0_0x7_0}``."""
    window = _HLO_WINDOW.search(rest)
    parts = window.group(1).split() if window else []
    fields = dict(part.split("=", 1) for part in parts if "=" in part)
    size = tuple(int(v) for v in fields.get("size", "").split("x") if v)
    stride = tuple(int(v) for v in fields.get("stride", "").split("x") if v) or (1,) * len(size)
    pads = [p.split("_") for p in fields.get("pad", "").split("x") if p]
    padding = tuple((int(lo), int(hi)) for lo, hi in pads) or ((0, 0),) * len(size)
    return size, stride, padding


def _hlo_family(op: str, rest: str, shape: tuple[int, ...], result_shape: tuple) -> str | None:
    """The family of a combining instruction; ``None`` for one that only copies (a
    reduction over size-1 dimensions, a window of one element)."""
    family = _HLO_FAMILIES.get(op)
    if family == "reduce" and math.prod(shape) == math.prod(result_shape):
        return None
    if family == "reduce_window":
        size, stride, padding = _hlo_window(rest)
        if math.prod(size) == 1:
            return None
        return "cumulative" if is_cumulative(shape, size, stride, padding) else family
    return family


def _hlo_sensitive(
    match: re.Match, operands: list, types: dict, computations: dict
) -> SensitiveOp | None:
    """The ``SensitiveOp`` of an HLO instruction, or ``None``.

    An elementwise operation computes in its operand's dtype; a reduction, window,
    scatter or all-reduce in the narrowest of its operand's dtype and the dtype its
    ``to_apply`` computation rounds to.
    """
    op, rest = match.group("op"), match.group("rest")
    if not operands:
        return None
    dtype, shape = operands[0]
    primitive = _HLO_ELEMENTWISE.get(op)
    if primitive is None:
        result_shape = types.get(match.group("name"), ("", ()))[1]
        family = _hlo_family(op, rest, shape, result_shape)
        applied = _HLO_TO_APPLY.search(rest)
        if family is None or applied is None:
            return None
        combiner, rounded = _hlo_combiner(computations.get(applied.group(1), []), types)
        primitive = combined_primitive(family, combiner)
        dtype = _narrowest([dtype, rounded or dtype])
    if primitive is None or dtype not in FLOAT_NAMES:
        return None
    name = _hlo_name(rest)
    return SensitiveOp(primitive, dtype, shape, name, direction(name), executions=None)


def read_compiled(text: str) -> tuple[list[dict[str, Any]], list[SensitiveOp], int]:
    """``(matmuls, sensitive, converts)`` of compiled HLO text, as ``read_lowered`` gives
    them for StableHLO (``executions`` unknown: the text's loops are not followed)."""
    computations = _hlo_computations(text)
    instructions = [m for m in map(_HLO_INSTR.match, text.splitlines()) if m]
    types = _hlo_types(instructions)
    ops, sensitive, converts = [], [], 0
    for match in instructions:
        operands = _hlo_operands(match.group("operands"), types)
        result = types.get(match.group("name"), ("unknown", ()))[0]
        if match.group("op") == "convert":
            if operands and operands[0][0] != result:
                converts += operands[0][0] in FLOAT_NAMES and result in FLOAT_NAMES
            continue
        matmul = _hlo_matmul(match, operands, result)
        if matmul is not None:
            ops.append(matmul)
        elif (found := _hlo_sensitive(match, operands, types, computations)) is not None:
            sensitive.append(found)
    return ops, sensitive, int(converts)
