"""The floor a mixed-precision layer's error is judged against: the error of the rounding no
recipe of its precision avoids; ``divergence`` from float32 per layer, and ``with_floor``,
which flags the layers above it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.autocast.api import autocast
from jaxamp._src.autocast.rules import (
    COMPUTE_PRIMITIVES,
    FLOAT32_PRIMITIVES,
    PROMOTE_PRIMITIVES,
    AutocastRules,
    primitive_names,
)
from jaxamp._src.numerics.numerics_diff import Measured, compare_runs, measure
from jaxamp._src.ops.block_scaling import quantize_blocks
from jaxamp._src.ops.fp8_scaling import quantize
from jaxamp._src.policy import Policy

# A layer is flagged when the variant's error exceeds FLAG_RATIO times its floor (the
# error of the variant's ideal recipe, whose only rounding is what no recipe avoids: see
# ``with_floor``) and is at least FLAG_MINIMUM (an error below 1% is no fault to chase).
# Healthy variants of the CPU default models sit at or below 1.6 times their floor where
# the error is 1% or more; planted precision faults (tests/compare/planted_faults_test.py)
# at 8 times or more.
FLAG_RATIO = 4.0
# A value of ordinary size whose norm the variant shrinks below this fraction of fp32's
# is flagged as flushed to zero (an underflow), whatever its floor.
LOST_SIZE = 0.5
FLAG_MINIMUM = 0.01


def divergence(
    reference: Callable | Measured,
    mixed: Callable,
    *args: Any,
    loss_scale: float | None = None,
) -> list[dict[str, Any]]:
    """Per layer and pass, how far ``mixed`` departs from ``reference`` (both losses of the
    same arguments, differentiated with respect to the first; ``mixed``'s loss multiplied
    by ``loss_scale`` as its training step does): the fields of
    ``jaxamp.numerics_diff``'s rows (``scale_error`` is the one to read). ``reference``
    may be measured once (``numerics_diff.measure(reference, args)``) for many variants."""
    if not isinstance(reference, Measured):
        reference = measure(reference, args)
    diff = compare_runs(reference, measure(mixed, args, loss_scale=loss_scale))
    return [
        {
            "layer": r.layer,
            "phase": r.phase,
            "relative_error": r.relative_error,
            "scale_error": r.scale_error,
            "cosine": r.cosine,
            "near_zero": r.near_zero,
            "size_ratio": r.size_ratio,
        }
        for r in diff.layers
        if r.relative_error is not None
    ]


def rounding_dtype(policy: Any) -> Any:
    """The dtype ``input_sensitivity`` rounds a variant's params and inputs to: its compute
    dtype, or under a float8 policy the float8 GEMMs' forward operand dtype (e4m3), or
    under a block-scaled policy the format's name (``"mxfp8"``, ``"nvfp4"``: rounded block
    by block along the last axis)."""
    if policy.fp8 is not None and policy.fp8.block is not None:
        return policy.fp8.block
    if policy.fp8 is not None:
        return np.dtype(jnp.float8_e4m3fn)
    return np.dtype(policy.compute_dtype)


def _rounded(x: Any, dtype: Any) -> Any:
    """``x`` rounded to ``dtype`` and back; to a float8 dtype with a per-tensor scale that
    maps its largest magnitude to the dtype's largest, as a float8 GEMM scales it."""
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
        return x
    if isinstance(dtype, str):  # a block-scaled format, in blocks along the last axis
        if x.ndim == 0:
            return x.astype(jnp.float32)
        q = quantize_blocks(x, dtype)
        return q.dequantized()[..., : x.shape[-1]] * q.tensor_scale
    if jnp.finfo(dtype).bits != 8:
        return x.astype(dtype).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return quantize(x, dtype, scale).astype(jnp.float32) * scale


def rounded_inputs(reference: Callable, dtype: Any) -> Callable:
    """``reference`` with its floating arguments (params, inputs) rounded to ``dtype`` and
    back to float32 first (``_rounded``): the model's own sensitivity to one rounding of
    what it is given, with no low-precision arithmetic inside (a floor of ``with_floor``)."""

    def perturbed(*args: Any) -> Any:
        return reference(*jax.tree.map(lambda x: _rounded(x, dtype), args))

    return perturbed


def input_sensitivity(
    reference: Callable, dtype: Any, *args: Any, measured: Measured | None = None
) -> dict[tuple[str, str], float]:
    """Per (layer, pass), the ``scale_error`` of the float32 ``reference`` with its params and
    inputs rounded to ``dtype`` (``rounded_inputs``) against ``reference`` (``measured``:
    ``reference`` on ``args`` measured already)."""
    rounded = rounded_inputs(reference, dtype)
    return _by_key(divergence(measured or reference, rounded, *args))


# What the floor's run computes in float32: every arithmetic primitive the rule table would
# run in the dtype that arrives, beside those it keeps in float32 (exact ones, a copy, a
# reshape, a max, are left as they arrive: they round nothing).
_ARITHMETIC = primitive_names(
    "add_p", "sub_p", "mul_p", "div_p", "rem_p", "atan2_p", "tanh_p", "sin_p", "cos_p", "atan_p"
) | {"add_any"}
GEMMS_ONLY = AutocastRules(
    compute=COMPUTE_PRIMITIVES,
    float32=FLOAT32_PRIMITIVES | _ARITHMETIC,
    promote=PROMOTE_PRIMITIVES - _ARITHMETIC,
)
"""The floor's rule table: matmuls and convolutions under the matmul rule (operands in the
compute dtype, float32 sums, results in the compute dtype), all other arithmetic in float32."""


def ideal_recipe(reference: Callable, policy: Any) -> Callable:
    """``reference`` as the ideal recipe of ``policy`` runs it: its matmuls and
    convolutions at ``policy``'s precision (``GEMMS_ONLY``: operands and results in the
    compute dtype, or float8 operands with current per-tensor scaling under a float8
    policy, sums in float32); the inputs of each Flax Linen layer stored at the compute
    dtype's precision (``lax.reduce_precision`` to its mantissa, in float32's range: the
    activations a recipe keeps in 16 bits, rounded inside the layer, so that its output
    stays its last value); every norm, reduction, softmax and elementwise operation in
    float32. The rounding no mixed-precision recipe avoids, and no more (a floor of
    ``with_floor``)."""
    fp8 = policy.fp8
    if fp8 is not None and fp8.scaling == "delayed":
        fp8 = dataclasses.replace(fp8, scaling="current")
    ideal = Policy(jnp.float32, policy.compute_dtype, jnp.float32, fp8=fp8)
    mantissa = int(jnp.finfo(policy.compute_dtype).nmant)

    def stored(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=mantissa)
        return x

    def inputs_stored(next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name == "__call__":  # in the layer's scope, before its first op
            args, kwargs = jax.tree.map(stored, (args, kwargs))
        return next_fun(*args, **kwargs)

    def rounded(*args: Any) -> Any:
        with nn.intercept_methods(inputs_stored):
            return reference(*args)

    return autocast(rounded, ideal, rules=GEMMS_ONLY)


def ideal_rounding(
    reference: Callable,
    policy: Any,
    *args: Any,
    loss_scale: float | None = None,
    measured: Measured | None = None,
) -> dict[tuple[str, str], float]:
    """Per (layer, pass), the ``scale_error`` of ``ideal_recipe(reference, policy)``
    against the float32 ``reference`` (its loss times ``loss_scale``, as the variant's;
    ``measured``: ``reference`` on ``args`` measured already)."""
    ideal = ideal_recipe(reference, policy)
    return _by_key(divergence(measured or reference, ideal, *args, loss_scale=loss_scale))


def with_floor(
    rows: list[dict[str, Any]],
    inputs: dict[tuple[str, str], float],
    ideal: dict[tuple[str, str], float],
    ratio: float = FLAG_RATIO,
) -> list[dict[str, Any]]:
    """``divergence``'s rows of a variant, each beside its floor and whether it is
    ``flagged``.

    Two floors, each a ``scale_error`` of the float32 model with only rounding no
    mixed-precision recipe avoids:

    * ``floor_inputs`` (``input_sensitivity``): its params and inputs rounded once to
      the variant's dtype: what the model makes of one rounding of what it is given,
      nonlinear effects (a ReLU or a max-pool that flips) included.
    * ``floor_ideal`` (``ideal_rounding``): the variant's ideal recipe
      (``ideal_recipe``): GEMMs at its precision, each layer's inputs stored at its
      compute dtype's, everything else in float32: what that rounding does downstream,
      amplified as the model amplifies it (a BatchNorm whose backward pass cancels, a
      LayerNorm of values far from 0). Where it is not finite (a GEMM overflowing
      float16) it is left out.

    ``floor`` is the larger. Neither computes a norm, a reduction, a softmax or any
    elementwise operation below float32, so a variant that does (a precision fault)
    stands above the floor at that layer by the error the fault adds; a recipe that
    keeps them in float32 rounds little more than the floor (some elementwise
    operations in 16 bits) and stays within ``FLAG_RATIO`` of it. A row is ``flagged``, with the
    ``fault`` that says why, when its value is not finite while the floor is (overflow,
    a NaN), when the norm of a value of ordinary size shrinks below ``LOST_SIZE`` of
    fp32's (an underflow), or when its error is at least ``FLAG_MINIMUM`` and more than
    ``ratio`` (default ``FLAG_RATIO``) times the floor.
    """
    for row in rows:
        key = (row["layer"], row["phase"])
        row["floor_inputs"], row["floor_ideal"] = inputs.get(key), ideal.get(key)
        floors = (row["floor_inputs"], row["floor_ideal"])
        known = [f for f in floors if f is not None and math.isfinite(f)]
        row["floor"] = max(known) if known else None
        row["fault"] = _fault(row, ratio)
        row["flagged"] = row["fault"] is not None
    return rows


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    return {(r["layer"], r["phase"]): r["scale_error"] for r in rows}


def _fault(row: dict[str, Any], ratio: float) -> str | None:
    """Why a row with a floor is flagged, or ``None``: ``"not finite"`` where the floor is
    finite; ``"lost ...% of its size"``, a value of fp32's ordinary size whose norm the
    variant shrinks below ``LOST_SIZE`` of fp32's (an underflow no floor stands for:
    rounding noise, however amplified, adds to a value's size, it does not erase it);
    ``"above its floor"``."""
    error, floor = row["scale_error"], row["floor"]
    if floor is None or not math.isfinite(floor):
        return None
    if not math.isfinite(error):
        return "not finite"
    size = row.get("size_ratio")
    if not row.get("near_zero") and size is not None and size < LOST_SIZE:
        return f"lost {1 - size:.0%} of its size: flushed to zero"
    if error >= FLAG_MINIMUM and error > ratio * floor:
        return "above its floor"
    return None
