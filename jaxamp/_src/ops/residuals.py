"""What the backward pass saves: 16-bit activations, not float32 temporaries
(``checkpoint_residuals``), and how many bytes that is (``activation_bytes``)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jaxamp._src.dtypes import is_floating, is_narrow, is_narrower
from jaxamp._src.errors import invalid_choice
from jaxamp._src.ops.primitives import amp_conv_general_dilated_p, amp_dot_general_p

RESIDUAL_MODES = ("compute_dtype", "dots", "all")

_ALWAYS_SAVEABLE = frozenset(
    p.name
    for p in (
        lax.dot_general_p,
        lax.conv_general_dilated_p,
        amp_dot_general_p,
        amp_conv_general_dilated_p,
        lax.reduce_sum_p,
        lax.reduce_max_p,
        lax.reduce_min_p,
        lax.reduce_prod_p,
        lax.reduce_and_p,
        lax.reduce_or_p,
        lax.argmax_p,
        lax.argmin_p,
    )
)
# Outputs that are cheaper to redo than to keep: they are made from smaller inputs.
_NEVER_SAVED = frozenset(p.name for p in (lax.broadcast_in_dim_p, lax.iota_p))
_BOOL_OUTPUT = frozenset(
    p.name for p in (lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.is_finite_p)
)


def _is_wide_float(dtype: Any) -> bool:
    return is_floating(dtype) and not is_narrow(dtype)


def _output_is_wide_float(prim: Any, avals: tuple[Any, ...], params: dict[str, Any]) -> bool:
    """Whether an equation's output is float32 or wider, judged from its inputs."""
    if prim.name == "convert_element_type":
        return _is_wide_float(params["new_dtype"])
    if prim.name in _BOOL_OUTPUT:
        return False
    for aval in avals:
        dtype = getattr(aval, "dtype", None)
        if (
            dtype is not None
            and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
            and _is_wide_float(dtype)
        ):
            return True
    return False


def _is_downcast(prim: Any, avals: tuple[Any, ...], params: dict[str, Any]) -> bool:
    """A convert from float32 (or wider) to a narrower float: cheap to redo from its input."""
    if prim.name != "convert_element_type" or not avals:
        return False
    src, dst = getattr(avals[0], "dtype", None), np.dtype(params["new_dtype"])
    return src is not None and _is_wide_float(src) and is_narrower(dst, src)


def save_compute_dtype(
    prim: Any, *avals: Any, input_shapes: frozenset[tuple[int, ...]] | None = None, **params: Any
) -> bool:
    """``jax.checkpoint`` policy: save all but float32 elementwise intermediates.

    Downcasts from float32 are saved unless their input is shaped like one of
    ``input_shapes`` (the shapes of the checkpointed function's float32 inputs):
    those are the 16-bit copies of float32 weights, which the backward pass redoes
    from the weight it holds anyway. ``None``: no downcast is saved. The matmul
    rule's results (its primitives' outputs, 16-bit activations) are saved.
    """
    if prim.name in _ALWAYS_SAVEABLE:
        return True
    if prim.name in _NEVER_SAVED:
        return False
    if _is_downcast(prim, avals, params):
        # A 16-bit cast of a float32 activation a matmul reads (a GELU computed in float32)
        # is saved: recomputed, the float32 work before it would run inside the transposing
        # copy that lays the activation out for the weight-gradient GEMM, which XLA:CPU
        # computes element by element in the transposed order, far slower than the forward.
        return input_shapes is not None and tuple(avals[0].shape) not in input_shapes
    return not _output_is_wide_float(prim, avals, params)


def save_dots(prim: Any, *avals: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy: save matmul, convolution and reduction outputs only."""
    return prim.name in _ALWAYS_SAVEABLE


_POLICIES = {"compute_dtype": save_compute_dtype, "dots": save_dots}


def validate_residuals(residuals: str) -> str:
    """Returns ``residuals`` if it is a known mode, else raises ``ValueError``."""
    if residuals not in RESIDUAL_MODES:
        raise invalid_choice("residuals mode", residuals, RESIDUAL_MODES)
    return residuals


def _is_numeric_array(x: Any) -> bool:
    """JAX arrays, and NumPy arrays and scalars JAX can take (not strings or objects)."""
    if isinstance(x, jax.Array):
        return True
    return isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "biufcV"


def partition_arrays(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``(arrays, rebuild)``: the array leaves of ``tree``, and a function that puts
    new arrays in their places, keeping the other leaves (numbers, strings,
    callables) as they are. Lets a transformation hold non-array arguments static."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [_is_numeric_array(x) for x in leaves]

    def rebuild(arrays: Sequence[Any]) -> Any:
        it = iter(arrays)
        return jax.tree.unflatten(
            treedef, [next(it) if a else x for x, a in zip(leaves, mask, strict=True)]
        )

    return [x for x, a in zip(leaves, mask, strict=True) if a], rebuild


def checkpoint_residuals(fun: Callable[..., Any], residuals: str = "compute_dtype") -> Callable:
    """Wraps ``fun`` so that its backward pass saves what ``residuals`` allows.

    Arguments that are not arrays (Python booleans, strings, callables) are held
    static, so the wrapped function takes the same arguments as ``fun``.

    Args:
      fun: the function to wrap (for example a model's ``apply``).
      residuals: ``"compute_dtype"``, ``"dots"`` or ``"all"`` (see the Activation memory
        guide, guides/activation-memory.md).

    Returns:
      The wrapped function (``fun`` itself for ``"all"``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def f(x):  # a float32 temporary between two 16-bit values
      ...     return jnp.sin(jnp.sin(x.astype(jnp.float32))).astype(jnp.bfloat16)
      >>> x = jnp.ones(1024, jnp.bfloat16)
      >>> activation_bytes(f, x) > activation_bytes(checkpoint_residuals(f), x)
      True
    """
    if validate_residuals(residuals) == "all":
        return fun
    policy = _POLICIES[residuals]

    @functools.wraps(fun)
    def wrapped(*args: Any) -> Any:
        arrays, rebuild = partition_arrays(args)
        chosen = policy
        if policy is save_compute_dtype:
            shapes = frozenset(
                tuple(x.shape)
                for x in jax.tree.leaves(arrays)
                if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
                and _is_wide_float(x.dtype)
            )
            chosen = functools.partial(save_compute_dtype, input_shapes=shapes)
        return jax.checkpoint(lambda arrays: fun(*rebuild(arrays)), policy=chosen)(arrays)

    return wrapped


def saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[tuple[Any, str]]:
    """The values ``jax.vjp(fun, *args)`` saves for the backward pass.

    Uses JAX's private ``jax._src.ad_checkpoint.saved_residuals`` (the function
    behind the public ``jax.ad_checkpoint.print_saved_residuals``).

    Args:
      fun: a function of arrays; close over anything static.
      *args: array arguments.
      **kwargs: array keyword arguments.

    Returns:
      ``(aval, description)`` pairs, one per saved value.
    """
    from jax._src import ad_checkpoint

    return ad_checkpoint.saved_residuals(fun, *args, **kwargs)


def activation_bytes(
    fun: Callable[..., Any], *args: Any, by_dtype: bool = False, **kwargs: Any
) -> int | dict[str, int]:
    """Bytes of activations ``fun``'s backward pass saves, on any backend.

    Residuals that are ``fun``'s own arguments (params, inputs) are not counted:
    they are held anyway.

    Args:
      fun: a function of arrays, typically ``lambda params: loss(params, batch)``.
      *args: its array arguments.
      by_dtype: return a ``{dtype name: bytes}`` breakdown instead of the total.
      **kwargs: its array keyword arguments.

    Returns:
      Total bytes, or bytes per dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> activation_bytes(lambda w: jnp.sum(jnp.sin(w) ** 2), jnp.ones(1000))  # sin(w), cos(w)
      8000
    """
    totals: collections.Counter[str] = collections.Counter()
    for aval, description in saved_residuals(fun, *args, **kwargs):
        if description.startswith("from the argument"):
            continue
        dtype = (
            np.dtype(aval.dtype)
            if not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
            else None
        )
        if dtype is None:
            continue
        totals[dtype.name] += int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize
    return dict(totals) if by_dtype else sum(totals.values())
