"""The rules that turn a policy into settings of Flax layers, shared by Linen and NNX.

A Flax layer already speaks the policy's language: ``dtype`` is its compute
dtype, ``param_dtype`` the dtype its parameters are created in, ``precision``
the precision of its matmuls. Applying a policy to an unmodified model means
setting those attributes on every layer, plus three things Flax's defaults do
not give:

* matmul layers get ``precision=BF16_BF16_F32`` (or ``F16_F16_F32``) where the
  backend has it, so float32 accumulation is stated in the program;
* attention layers that use Flax's default ``attention_fn`` get
  :func:`jaxamp.dot_product_attention` (16-bit matmuls, float32 softmax);
* embedding lookups gather in the parameter dtype and cast the gathered rows,
  so the gradient is scatter-added into the table in float32.

Normalisation layers compute their statistics in at least float32 whatever
their ``dtype`` (Flax promotes to float32), so setting their ``dtype`` only
makes them emit compute-dtype activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxamp._src import attention
from jaxamp._src.backend import dot_algorithm
from jaxamp._src.policy import Policy, get_policy

# Layers whose matmuls take a ``precision``; they get a float32-accumulating dot algorithm.
DOT_LAYERS: tuple[type, ...] = (
    nn.Dense,
    nn.DenseGeneral,
    nn.Einsum,
    nn.MultiHeadDotProductAttention,
    nn.MultiHeadAttention,
    nnx.Linear,
    nnx.LinearGeneral,
    nnx.Einsum,
    nnx.MultiHeadAttention,
)
EMBED_LAYERS: tuple[type, ...] = (nn.Embed, nnx.Embed)
_FLAX_ATTENTION_FNS = (nn.dot_product_attention, nnx.dot_product_attention)

OverrideKey = "str | type"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What to do to one layer for one call.

    Attributes:
      attributes: ``(name, value)`` pairs to set on the layer.
      cast_output_to: dtype to cast the floating outputs to, or ``None``.
      matmul_precision: ``jax.default_matmul_precision`` for the call, for a layer
        whose matmul takes no ``precision`` (``Embed.attend``), or ``None``.
    """

    attributes: tuple[tuple[str, Any], ...] = ()
    cast_output_to: Any = None
    matmul_precision: Any = None

    def __bool__(self) -> bool:
        return (
            bool(self.attributes)
            or self.cast_output_to is not None
            or self.matmul_precision is not None
        )

    def context(self):
        """The matmul-precision context to run the call in."""
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision.name)


def _is_float_setting(value: Any) -> bool:
    """Whether a ``dtype``-like attribute holds a floating dtype (or nothing yet)."""
    if value is None:
        return True
    try:
        return jnp.issubdtype(np.dtype(value), jnp.floating)
    except TypeError:
        return False


def plan_layer(module: Any, policy: Policy, method_name: str = "__call__") -> LayerPlan:
    """Returns the settings that run ``module.<method_name>`` under ``policy``.

    Args:
      module: a Linen or NNX module.
      policy: the policy that applies to it.
      method_name: the method being called (Linen interceptors know it; NNX
        settings are made once, for ``__call__``).

    Returns:
      A :class:`LayerPlan`; empty when the module has nothing to set.
    """
    attrs: dict[str, Any] = {}
    cast_output_to = matmul_precision = None
    if hasattr(module, "param_dtype") and _is_float_setting(module.param_dtype):
        attrs["param_dtype"] = policy.param_dtype
    if hasattr(module, "dtype") and _is_float_setting(module.dtype):
        attrs["dtype"] = policy.compute_dtype
    if isinstance(module, EMBED_LAYERS):
        if method_name == "attend":  # a matmul against the table, with no precision field
            matmul_precision = dot_algorithm(policy.compute_dtype)
        else:  # gather in the table's dtype, then cast the rows (see the module docstring)
            attrs.pop("dtype", None)
            cast_output_to = policy.compute_dtype
    if isinstance(module, (*DOT_LAYERS, *EMBED_LAYERS)) and getattr(module, "precision", 1) is None:
        algorithm = dot_algorithm(policy.compute_dtype)
        if algorithm is not None:
            attrs["precision"] = algorithm
    if getattr(module, "attention_fn", None) in _FLAX_ATTENTION_FNS:
        attrs["attention_fn"] = attention.dot_product_attention
    changed = tuple((k, v) for k, v in attrs.items() if getattr(module, k) is not v)
    return LayerPlan(changed, cast_output_to, matmul_precision)


def normalize_overrides(
    overrides: Mapping[Any, Any] | Iterable[tuple[Any, Any]] | None,
) -> tuple[tuple[Any, Policy], ...]:
    """Validates ``overrides`` and parses their policies.

    Args:
      overrides: a mapping (or pairs) from a key to a policy spec. A key is a
        module class (the policy applies to its instances and everything inside
        them) or a glob pattern matched against a module's path, such as
        ``"head"``, ``"Dense_*"`` or ``"encoder/*/attention"`` (a pattern also
        matches at the end of a path, and applies to the subtree below a match).

    Returns:
      A tuple of ``(key, Policy)`` pairs, in the given order.

    Raises:
      TypeError: for a key that is neither a string nor a class.
      ValueError: for a value that names no policy.
    """
    if overrides is None:
        return ()
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    result = []
    for key, spec in items:
        if not isinstance(key, (str, type)):
            raise TypeError(
                f"An override key must be a module class or a path pattern (str), got {key!r}."
            )
        result.append((key, get_policy(spec)))
    return tuple(result)


def _path_matches(path: tuple[Any, ...], pattern: str) -> bool:
    text = "/".join(str(p) for p in path)
    return fnmatch.fnmatchcase(text, pattern) or fnmatch.fnmatchcase(text, "*/" + pattern)


def resolve_policy(
    default: Policy,
    overrides: tuple[tuple[Any, Policy], ...],
    chain: Iterable[tuple[tuple[Any, ...], Any]],
) -> Policy:
    """The policy for a module, from the innermost matching override outwards.

    Args:
      default: the policy when no override matches.
      overrides: as returned by :func:`normalize_overrides`.
      chain: ``(path, module)`` pairs from the module itself up to the root.

    Returns:
      The policy of the closest override that matches, else ``default``.
    """
    if not overrides:
        return default
    for path, module in chain:
        for key, policy in overrides:
            if isinstance(key, type):
                if isinstance(module, key):
                    return policy
            elif path and _path_matches(tuple(path), key):
                return policy
    return default
