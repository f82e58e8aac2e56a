"""The one dtype vocabulary: names, predicates and upcasts shared by every module."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp._src.errors import invalid_choice

T = TypeVar("T")

FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

# Floating dtypes a policy may name, with their canonical spelling.
POLICY_DTYPES = {
    np.dtype(jnp.float32): "float32",
    np.dtype(jnp.bfloat16): "bfloat16",
    np.dtype(jnp.float16): "float16",
    np.dtype(jnp.float64): "float64",
}

# The dtype names of jmp's grammar; "half" is float16, or bfloat16 on TPU.
JMP_DTYPE_NAMES = (
    "f32",
    "float32",
    "full",
    "bf16",
    "bfloat16",
    "f16",
    "float16",
    "half",
    "f64",
    "float64",
)

# StableHLO / HLO element type names -> numpy names.
HLO_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "f16": "float16",
    "f32": "float32",
    "f64": "float64",
    "f8E4M3FN": "float8_e4m3fn",
    "f8E5M2": "float8_e5m2",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "i1": "bool",
    "pred": "bool",
    "i8": "int8",
    "s8": "int8",
    "i32": "int32",
    "s32": "int32",
    "ui32": "uint32",
    "u32": "uint32",
    "i64": "int64",
    "s64": "int64",
}


def promote(*dtypes: Any) -> np.dtype:
    """JAX's standard promotion of ``dtypes`` (float16 with float32 is float32), whatever
    ``jax_numpy_dtype_promotion`` says: the rules' own choice of a wider dtype, not an
    implicit promotion of a user's values, which under ``"strict"`` JAX refuses.

    Examples:
      >>> import jax.numpy as jnp
      >>> promote(jnp.bfloat16, jnp.float32)
      dtype('float32')
    """
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def hlo_dtype_name(element_type: str) -> str:
    """The numpy name of an HLO or StableHLO element type (``"bf16"``: ``"bfloat16"``)."""
    return HLO_DTYPE_NAMES.get(element_type, element_type)


SIXTEEN_BIT_NAMES = frozenset({"bfloat16", "float16"})

# The numpy names of the floating element types a lowered program may hold.
FLOAT_NAMES = frozenset(
    {"bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
)


def _is_kind(dtype: Any, kind: Any) -> bool:
    """Whether ``dtype`` is a dtype of ``kind``; ``None`` (numpy's float64) and anything
    that is not a dtype (an equation's axes, a jaxpr) are not."""
    if dtype is None:
        return False
    try:
        return jnp.issubdtype(dtype, kind)
    except TypeError:  # not a dtype
        return False


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating dtype (bfloat16 included; ``None``, or anything
    that is not a dtype, is not)."""
    return _is_kind(dtype, jnp.floating)


def is_inexact(dtype: Any) -> bool:
    """Whether ``dtype`` is floating or complex (what optax updates)."""
    return _is_kind(dtype, jnp.inexact)


def is_16bit(dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit floating dtype (bfloat16 or float16).

    Examples:
      >>> import jax.numpy as jnp
      >>> is_16bit(jnp.bfloat16), is_16bit(jnp.float32), is_16bit(jnp.int16)
      (True, False, False)
    """
    return is_floating(dtype) and np.dtype(dtype).itemsize == 2


def is_float16(dtype: Any) -> bool:
    """Whether ``dtype`` is float16, the 16-bit float of narrow range (bfloat16 is not).

    Examples:
      >>> import jax.numpy as jnp
      >>> is_float16(jnp.float16), is_float16(jnp.bfloat16), is_float16(jnp.float32)
      (True, False, False)
    """
    return is_floating(dtype) and np.dtype(dtype) == np.float16


def is_narrow(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating dtype narrower than float32 (16 or 8 bits)."""
    return is_floating(dtype) and np.dtype(dtype).itemsize < 4


def is_narrower(dtype: Any, than: Any) -> bool:
    """Whether ``dtype`` and ``than`` are floating and ``dtype`` has fewer bits."""
    return (
        is_floating(dtype)
        and is_floating(than)
        and np.dtype(dtype).itemsize < np.dtype(than).itemsize
    )


def is_float64(dtype: Any) -> bool:
    """Whether ``dtype`` is float64 and JAX computes in it (``jax_enable_x64`` is on).

    A policy leaves such values as written, as ``torch.autocast`` leaves float64. Without
    x64 JAX takes a float64 array (NumPy's default) as float32, and so does a policy.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> with jax.enable_x64(True):
      ...     is_float64(jnp.float64)
      True
      >>> with jax.enable_x64(False):
      ...     is_float64(jnp.float64)
      False
    """
    return (
        is_floating(dtype)
        and np.dtype(dtype) == FLOAT64
        and np.dtype(jax.dtypes.canonicalize_dtype(FLOAT64)) == FLOAT64
    )


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array or a tracer (not a Python number, not ``None``)."""
    return isinstance(x, (np.ndarray, np.generic, jax.Array))


def is_floating_array(x: Any) -> bool:
    """Whether ``x`` is an array (or tracer) with a floating dtype; PRNG keys are not."""
    return is_array(x) and is_floating(x.dtype)


def is_inexact_array(x: Any) -> bool:
    """Whether ``x`` is an array (or tracer) with a floating or complex dtype."""
    return is_array(x) and is_inexact(x.dtype)


def is_narrow_array(x: Any) -> bool:
    """Whether ``x`` is an array (or tracer) of a floating dtype narrower than float32."""
    return is_array(x) and is_narrow(x.dtype)


def upcast(x: Any) -> Any:
    """``x`` in float32 if it is a floating array narrower than float32, else ``x`` itself.

    Examples:
      >>> import jax.numpy as jnp
      >>> upcast(jnp.ones(2, jnp.bfloat16)).dtype, upcast(jnp.ones(2, jnp.int32)).dtype
      (dtype('float32'), dtype('int32'))
    """
    return x.astype(FLOAT32) if is_narrow_array(x) else x


def upcast_16bit(x: Any) -> Any:
    """``x`` in float32 if it holds 16-bit floats, else ``x`` itself. Unlike ``upcast``, a
    float8 array is kept, and a scalar that carries a 16-bit dtype without being an array
    (a literal of a traced program: JAX gives its Python scalars a dtype) is widened, to
    a NumPy float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> upcast_16bit(jnp.ones(2, jnp.float16)).dtype
      dtype('float32')
      >>> upcast_16bit(jnp.ones(2, jnp.float8_e4m3fn)).dtype
      dtype(float8_e4m3fn)
    """
    if not is_16bit(getattr(x, "dtype", None)):
        return x
    return x.astype(FLOAT32) if hasattr(x, "astype") else np.float32(x)


def float32_tree(tree: T) -> T:
    """Every floating array leaf of ``tree`` as a float32 array of its own; a float64 leaf
    under ``jax_enable_x64`` (``is_float64``) as it is.

    Unlike ``jaxamp.cast_floating(tree, float32)``, a leaf already in float32 is cast
    too, so a weakly typed one (``jnp.asarray(1.0)``) becomes strongly typed: state
    built from these leaves keeps one dtype from step to step.

    Examples:
      >>> import jax.numpy as jnp
      >>> out = float32_tree({"w": jnp.ones(2, jnp.bfloat16), "s": jnp.asarray(1.0)})
      >>> out["w"].dtype, out["s"].weak_type
      (dtype('float32'), False)
    """

    def cast(x: Any) -> Any:
        return x.astype(FLOAT32) if is_floating_array(x) and not is_float64(x.dtype) else x

    return jax.tree.map(cast, tree)


def canonical_dtype(value: Any, what: str = "dtype") -> np.dtype:
    """Returns ``value`` as a floating ``numpy.dtype``.

    Args:
      value: a dtype, a scalar type such as ``jnp.bfloat16``, or a name from jmp's
        grammar (``"bf16"``, ``"float32"``, ``"full"``, ``"half"``...).
      what: how to call the value in an error message.

    Returns:
      The canonical ``numpy.dtype``.

    Raises:
      ValueError: if ``value`` names no floating dtype.

    Examples:
      >>> canonical_dtype("f16")
      dtype('float16')
    """
    if value is None:  # numpy would read it as float64
        raise invalid_choice(what, value, POLICY_DTYPES.values())
    if isinstance(value, str):
        name = value.strip().lower()
        if name not in JMP_DTYPE_NAMES:
            raise invalid_choice(what, value, JMP_DTYPE_NAMES)
        # jmp parses its own names (a bare dtype is a policy in jmp).
        return np.dtype(jmp.get_policy(name).param_dtype)
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise invalid_choice(what, value, POLICY_DTYPES.values()) from e
    if dtype not in POLICY_DTYPES:
        raise invalid_choice(
            what,
            dtype.name,
            POLICY_DTYPES.values(),
            why=f"{what} must be a floating dtype, got {dtype.name!r}.",
        )
    return dtype
