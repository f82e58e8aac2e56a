"""The precision audit's reading of a lowered program: its matmuls and sensitive operations,
each with dtype, layer, pass and executions, and the problems a mixed-precision reviewer flags."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from typing import Any

import numpy as np

from jaxamp._src.audit.stablehlo import WalkedOp, tensor_type, walk
from jaxamp._src.dtypes import FLOAT_NAMES, SIXTEEN_BIT_NAMES, canonical_dtype, hlo_dtype_name
from jaxamp._src.jaxprs import FP8_SCOPE, is_backward_name
from jaxamp._src.policy import get_policy, is_policy_spec

# StableHLO/CHLO operation -> the JAX primitive it lowers.
_ELEMENTWISE = {
    "stablehlo.exponential": "exp",
    "stablehlo.exponential_minus_one": "expm1",
    "stablehlo.log": "log",
    "stablehlo.log_plus_one": "log1p",
    "stablehlo.logistic": "logistic",
    "stablehlo.rsqrt": "rsqrt",
    "stablehlo.sqrt": "sqrt",
    "stablehlo.power": "pow",
    "stablehlo.tan": "tan",
    "chlo.tan": "tan",
    "chlo.erf": "erf",
    "chlo.erfc": "erfc",
    "chlo.erf_inv": "erf_inv",
    "chlo.lgamma": "lgamma",
    "chlo.digamma": "digamma",
    "chlo.cosh": "cosh",
    "chlo.sinh": "sinh",
}
# Operations that combine values with the operation of their body (``add``, ``multiply``,
# ``maximum``, ``minimum``), by family -> {combiner: the JAX primitive they compute}.
_COMBINED = {
    "reduce": {
        "add": "reduce_sum",
        "multiply": "reduce_prod",
        "maximum": "reduce_max",
        "minimum": "reduce_min",
    },
    "reduce_window": {
        "add": "reduce_window_sum",
        "multiply": "reduce_window_prod",
        "maximum": "reduce_window_max",
        "minimum": "reduce_window_min",
    },
    "cumulative": {
        "add": "cumsum",
        "multiply": "cumprod",
        "maximum": "cummax",
        "minimum": "cummin",
    },
    "scatter": {
        "add": "scatter_add",
        "multiply": "scatter_mul",
        "maximum": "scatter_max",
        "minimum": "scatter_min",
    },
    "all_reduce": {"add": "psum", "multiply": "pprod", "maximum": "pmax", "minimum": "pmin"},
    "reduce_scatter": {
        "add": "psum_scatter",
        "multiply": "reduce_scatter_prod",
        "maximum": "reduce_scatter_max",
        "minimum": "reduce_scatter_min",
    },
}
_FAMILIES = {
    "stablehlo.reduce": "reduce",
    "stablehlo.reduce_window": "reduce_window",
    "stablehlo.scatter": "scatter",
    "stablehlo.all_reduce": "all_reduce",
    "stablehlo.reduce_scatter": "reduce_scatter",
    "chlo.scan": "cumulative",  # a GPU lowering of cumsum (JAX 0.10 leaves it off)
}
# Maxima and minima select one of their inputs: exact in any dtype.
EXACT = frozenset(
    primitive
    for table in _COMBINED.values()
    for combiner, primitive in table.items()
    if combiner in ("maximum", "minimum")
)
_ALGORITHM = re.compile(r"accumulation_type\s*=\s*(\w+)")


def direction(name: str) -> str:
    if not name:
        return "unknown"
    return "backward" if is_backward_name(name) else "forward"


# Name-stack entries JAX's transformations add, which are not layers.
_NOT_LAYERS = frozenset(
    {
        "checkpoint",
        "rematted_computation",
        "remat",
        "while",
        "cond",
        "closed_call",
        "core_call",
        "scan",
        "pjit",
        "custom_vjp_call",
        "custom_jvp_call",
        "jaxamp_float32",  # the scope of code kept as traced (autocast_interpreter.FLOAT32_SCOPE)
    }
)


# Entries JAX adds inside a transformation's own entry: ``while/body``, ``cond/branch_1_fun``.
# Elsewhere they are a user's layer names.
_AFTER = {"while": re.compile(r"body|cond"), "cond": re.compile(r"branch(_\d+)?(_fun)?")}
_POLICY_MODULE = re.compile(r"PolicyModule(_\d+)?")
_POLICY_CALL = ".jaxamp_policy"  # the wrapper's lifted call (``linen_policy._TARGET``)


def short_name(name: str) -> str:
    """The layer path of a source name: ``jit(f)/transpose(jvp(M))/Dense_0/dot_general``
    -> ``M/Dense_0`` (entries that transformations add, such as ``checkpoint``, dropped)."""
    layers: list[str] = []
    previous = ""
    for raw in [p for p in name.split("/") if p][1:-1]:
        part = re.sub(r"^(?:\w+\()+|\)+$", "", raw)  # transpose(jvp(M)) -> M
        wrapper = previous.endswith(_POLICY_CALL)
        inside = _AFTER.get(previous)
        previous = part
        if inside is not None and inside.fullmatch(part):
            continue
        if part.endswith(_POLICY_CALL) or _POLICY_MODULE.fullmatch(part):
            continue  # jaxamp.linen's wrapper (named after the model it wraps, or PolicyModule_0)
        if wrapper and part == "module":
            continue  # the wrapped model, named after the wrapper's field
        if raw != part and layers and layers[-1] == part:
            continue  # a transformation of the same module again (a remat's recomputation)
        if part and part not in _NOT_LAYERS:
            layers.append(part)
    return "/".join(layers)


@dataclasses.dataclass(frozen=True)
class SensitiveOp:
    """One numerically sensitive operation of a program.

    Attributes:
      primitive: the JAX primitive it lowers (``"exp"``, ``"reduce_sum"``, ``"cumsum"``,
        ``"reduce_window_sum"``, ``"scatter_add"``, ``"psum"``...).
      dtype: the dtype it computes in (its first operand's; in compiled HLO, the
        narrower type a reduction's body rounds its partial results to, if any),
        e.g. ``"bfloat16"``.
      shape: that operand's shape.
      name: the source name JAX recorded.
      direction: ``"forward"``, ``"backward"`` or ``"unknown"``.
      executions: how many times it runs per call (scan lengths and repeated
        calls multiply), or ``None`` inside a loop of unknown trip count and in
        a report read from compiled HLO text.
    """

    primitive: str
    dtype: str
    shape: tuple[int, ...]
    name: str = ""
    direction: str = "unknown"
    executions: int | None = 1

    @property
    def layer(self) -> str:
        """The layer path, e.g. ``"Model/attention"``."""
        return short_name(self.name)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A precision problem: what, in which dtype, where.

    Attributes:
      kind: ``"sensitive_in_16bit"``, ``"float32_matmul"`` or ``"16bit_accumulation"``.
      primitive: the primitive (``"exp"``, ``"dot_general"``...).
      dtype: the dtype it computes in.
      layer: the layer path.
      direction: the pass.
      executions: how many times it runs per call.
    """

    kind: str
    primitive: str
    dtype: str
    layer: str
    direction: str
    executions: int | None

    def __str__(self) -> str:
        what = {
            "sensitive_in_16bit": f"{self.primitive} computed in {self.dtype}",
            "float32_matmul": f"{self.primitive} on {self.dtype} operands (not the compute dtype)",
            "16bit_accumulation": f"{self.primitive} accumulating in {self.dtype}",
        }[self.kind]
        runs = "?" if self.executions is None else self.executions
        return f"{what} at {self.layer or '<top level>'} ({self.direction}, runs {runs}x)"


class PrecisionError(AssertionError):
    """Raised by ``PrecisionReport.check`` when a program has precision problems.

    Attributes:
      problems: the ``Problem`` list.
    """

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} precision problem(s):\n{lines}")


PrecisionError.__module__ = "jaxamp.debug"  # raised to users as jaxamp.debug.PrecisionError


def _operand_dtype(operation: Any) -> tuple[tuple[int, ...], str]:
    shape, element = tensor_type(operation.operands[0])
    return shape, hlo_dtype_name(element)


def combined_primitive(family: str, combiner: str | None) -> str | None:
    """The primitive an operation of ``family`` computes with ``combiner``.

    Args:
      family: ``"reduce"``, ``"reduce_window"``, ``"cumulative"``, ``"scatter"``,
        ``"all_reduce"`` or ``"reduce_scatter"``.
      combiner: the operation of its body: ``"add"``, ``"multiply"``, ``"maximum"``
        or ``"minimum"`` (anything else, or ``None``, is not a known combination).

    Returns:
      e.g. ``"reduce_sum"``, ``"cumsum"``, ``"scatter_add"``, ``"psum"``; ``None``
      for a body that is not one of those combiners (a scatter that sets values).
    """
    return _COMBINED.get(family, {}).get(combiner or "")


def is_cumulative(
    shape: tuple[int, ...],
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: tuple[tuple[int, int], ...],
) -> bool:
    """Whether a reduce-window is a cumulative reduction (JAX's ``cumsum`` lowering).

    Along one axis of length ``n`` the window spans the whole axis and the operand
    is padded by ``n - 1`` before it (or after it, reversed), so that the result
    keeps the operand's shape; the window is 1 wide on every other axis, with unit
    strides and no padding.

    Args:
      shape: the operand's shape.
      window: the window's size along each axis.
      strides: the window's strides.
      padding: ``(low, high)`` padding along each axis.

    Returns:
      ``True`` for a cumulative reduction.

    Examples:
      >>> is_cumulative((6, 3), (6, 1), (1, 1), ((5, 0), (0, 0)))  # cumsum over axis 0
      True
      >>> is_cumulative((2, 8, 8, 3), (1, 2, 2, 1), (1, 1, 1, 1), ((0, 0),) * 4)  # pooling
      False
    """
    axes = [axis for axis, size in enumerate(window) if size != 1]
    if len(axes) != 1 or len(shape) != len(window) or any(s != 1 for s in strides):
        return False
    (axis,) = axes
    n = shape[axis]
    if window[axis] != n or tuple(padding[axis]) not in ((n - 1, 0), (0, n - 1)):
        return False
    return all(tuple(p) == (0, 0) for i, p in enumerate(padding) if i != axis)


def _body_combiner(operation: Any) -> str | None:
    """The one operation of a body that combines two values (``stablehlo.add`` ->
    ``"add"``); ``None`` for a body that does more (an ``argmax``, a ``logaddexp``)."""
    if not operation.regions:
        return None
    *combining, _ = (o.operation.name for o in operation.regions[0].blocks[0].operations)
    if len(combining) != 1:
        return None
    return combining[0].removeprefix("stablehlo.")


def _dense_ints(text: str, count: int) -> tuple[int, ...]:
    """The integers of ``dense<[[5, 0], [0, 0]]> : ...`` (a splat repeated ``count`` times)."""
    values = [int(v) for v in re.findall(r"-?\d+", text.partition(">")[0])]
    return tuple(values * count) if len(values) == 1 else tuple(values)


def _i64_array(operation: Any, name: str, rank: int) -> tuple[int, ...]:
    """An ``array<i64: 1, 2>`` attribute of ``operation``; ones when it is absent."""
    text = _attribute(operation, name)
    if not text:
        return (1,) * rank
    return tuple(int(v) for v in re.findall(r"-?\d+", text.partition(":")[2]))


def _window_family(operation: Any) -> str | None:
    """``"cumulative"`` or ``"reduce_window"`` for a ``stablehlo.reduce_window``; ``None``
    for a window of one element (a copy, which accumulates nothing)."""
    shape = tensor_type(operation.operands[0])[0]
    window = _i64_array(operation, "window_dimensions", len(shape))
    if math.prod(window) == 1:
        return None
    strides = _i64_array(operation, "window_strides", len(shape))
    flat = _dense_ints(_attribute(operation, "padding") or "dense<0>", 2 * len(shape))
    padding = tuple(zip(flat[::2], flat[1::2], strict=True))
    return "cumulative" if is_cumulative(shape, window, strides, padding) else "reduce_window"


def _primitive(operation: Any) -> str | None:
    """The sensitive JAX primitive a StableHLO/CHLO operation computes, else ``None``."""
    name = operation.name
    if name in _ELEMENTWISE:
        return _ELEMENTWISE[name]
    family = _FAMILIES.get(name)
    if family == "reduce_window":
        family = _window_family(operation)
    return None if family is None else combined_primitive(family, _body_combiner(operation))


def _is_copy(operation: Any, shape: tuple[int, ...]) -> bool:
    """A reduction over size-1 dimensions only (a broadcast's transpose): a copy."""
    if operation.name != "stablehlo.reduce":
        return False
    return math.prod(shape) == math.prod(tensor_type(operation.results[0])[0])


def _sensitive(op: WalkedOp) -> SensitiveOp | None:
    operation = op.operation
    if not operation.operands:
        return None
    primitive = _primitive(operation)
    if primitive is None:
        return None
    shape, dtype = _operand_dtype(operation)
    if dtype not in FLOAT_NAMES or _is_copy(operation, shape):
        return None
    return SensitiveOp(primitive, dtype, shape, op.name, direction(op.name), op.executions)


def _attribute(operation: Any, name: str) -> str:
    try:
        return str(operation.attributes[name])
    except KeyError:
        return ""


def _converted_from(value: Any) -> str | None:
    """The dtype a value was converted from, if a ``stablehlo.convert`` defines it."""
    owner = getattr(getattr(value, "owner", None), "operation", None)
    if owner is None or owner.name != "stablehlo.convert" or not owner.operands:
        return None
    return hlo_dtype_name(tensor_type(owner.operands[0])[1])


def _upcast_operands(operation: Any, lhs: str, rhs: str) -> str | None:
    """The 16-bit dtype of a float32 GEMM's operands that were both converted from it
    (jaxamp's ``upcast`` matmul form), else ``None``."""
    if (lhs, rhs) != ("float32", "float32"):
        return None
    sources = {_converted_from(v) for v in operation.operands[:2]}
    return next(iter(sources)) if len(sources) == 1 and sources <= SIXTEEN_BIT_NAMES else None


def is_float8_gemm(name: str, lhs: str, rhs: str) -> bool:
    """Whether a GEMM is one of jaxamp's float8 GEMMs (named in its scope) or on float8."""
    return FP8_SCOPE in name or lhs.startswith("float8") or rhs.startswith("float8")


def read_lowered(module: Any) -> tuple[list[dict[str, Any]], list[SensitiveOp], int]:
    """Matmuls (as field dicts for ``MatmulOp``), sensitive operations and the number
    of floating converts of a lowered StableHLO module (``compiler_ir("stablehlo")``)."""
    matmuls, sensitive, converts = [], [], 0
    for op in walk(module):
        operation = op.operation
        name = operation.name
        if name == "stablehlo.convert" and operation.operands and operation.results:
            src = hlo_dtype_name(tensor_type(operation.operands[0])[1])
            dst = hlo_dtype_name(tensor_type(operation.results[0])[1])
            converts += src != dst and src in FLOAT_NAMES and dst in FLOAT_NAMES
        elif name in ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"):
            (lhs_shape, lhs), (rhs_shape, rhs) = (tensor_type(v) for v in operation.operands[:2])
            lhs, rhs = hlo_dtype_name(lhs), hlo_dtype_name(rhs)
            result = hlo_dtype_name(tensor_type(operation.results[0])[1])
            algorithm = _ALGORITHM.search(_attribute(operation, "algorithm"))
            accumulation = hlo_dtype_name(algorithm.group(1)) if algorithm else None
            upcast = _upcast_operands(operation, lhs, rhs)
            if upcast is not None:
                lhs = rhs = upcast
                accumulation = "float32"
            matmuls.append(
                dict(
                    kind="convolution" if name.endswith("convolution") else "dot_general",
                    lhs_dtype=lhs,
                    rhs_dtype=rhs,
                    result_dtype=result,
                    accumulation_dtype=accumulation,
                    upcast=upcast is not None,
                    lhs_shape=lhs_shape,
                    rhs_shape=rhs_shape,
                    name=op.name,
                    direction=direction(op.name),
                    executions=op.executions,
                    float8=is_float8_gemm(op.name, lhs, rhs),
                    contracts=name != "stablehlo.dot_general"
                    or "contracting_dimensions" in _attribute(operation, "dot_dimension_numbers"),
                )
            )
        else:
            found = _sensitive(op)
            if found is not None:
                sensitive.append(found)
    return matmuls, sensitive, int(converts)


def _ignored(layer: str, ignore: tuple[str, ...]) -> bool:
    """Whether ``layer`` or a layer above it matches a glob pattern in ``ignore``."""
    parts = layer.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, f"*/{pattern}")
        for prefix in prefixes
        for pattern in ignore
    )


def find_problems(report: Any, compute_dtype: Any = None, ignore: tuple[str, ...] = ()) -> list:
    """The ``Problem`` list of a ``PrecisionReport`` (see the Precision audit guide,
    guides/precision-audit.md)."""
    compute = compute_dtype_name(compute_dtype)
    problems = []
    for op in report.sensitive:
        if op.dtype in SIXTEEN_BIT_NAMES and op.primitive not in EXACT:
            problems.append(
                Problem(
                    "sensitive_in_16bit",
                    op.primitive,
                    op.dtype,
                    op.layer,
                    op.direction,
                    op.executions,
                )
            )
    for op in report.ops:
        if not op.contracts:  # an einsum that only multiplies: nothing to accumulate
            continue
        if getattr(op, "float8", False) and not op.float8_operands:
            continue  # a float8 GEMM a CPU computes on float32 copies: by design
        layer = short_name(op.name)
        operands = {op.lhs_dtype, op.rhs_dtype}
        vector_dot = len(op.lhs_shape) == 1 and len(op.rhs_shape) == 1  # float32 by rule
        if compute in SIXTEEN_BIT_NAMES and operands == {"float32"} and not vector_dot:
            problems.append(
                Problem("float32_matmul", op.kind, "float32", layer, op.direction, op.executions)
            )
        elif (
            operands <= SIXTEEN_BIT_NAMES
            and op.result_dtype in SIXTEEN_BIT_NAMES
            and op.accumulation_dtype in (None, *SIXTEEN_BIT_NAMES)
        ):
            problems.append(
                Problem(
                    "16bit_accumulation",
                    op.kind,
                    op.result_dtype,
                    layer,
                    op.direction,
                    op.executions,
                )
            )
    return [p for p in problems if not _ignored(p.layer, tuple(ignore))]


def compute_dtype_name(value: Any) -> str | None:
    """The compute dtype ``check``/``problems`` hold the program to, by name: from a
    dtype, a dtype name in any case (``"BF16"``, ``"bfloat16"``), a policy or a policy
    spec (``"mixed_bfloat16"``: its compute dtype). An unknown name raises, naming the
    valid choices: a typo must not turn the float32-matmul check off."""
    if value is None:
        return None
    if is_policy_spec(value):
        spec = hlo_dtype_name(value.strip().lower()) if isinstance(value, str) else value
        return get_policy(spec).compute_dtype.name
    return canonical_dtype(value, "compute_dtype").name


def canonical_dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return hlo_dtype_name(dtype)
    return np.dtype(dtype).name
