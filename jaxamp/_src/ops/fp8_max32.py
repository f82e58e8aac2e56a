"""The ``fp8_max32`` dtype: float32 values whose cotangents combine by ``max`` (JAX internals)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax

# An extended dtype whose cotangents combine by max (the FP8 state under fan-in), as
# Flax's fp8_ops defines one: JAX's registry of extended dtypes lives in jax._src.
from jax._src import ad_util as _ad_util
from jax._src import core as _jax_core
from jax._src import dtypes as _jax_dtypes
from jax._src import earray as _earray
from jax._src.interpreters import pxla as _pxla

from jaxamp._src.dtypes import FLOAT32


class _MaxRules:
    """Rules of the ``fp8_max32`` dtype: float32 values whose cotangents add by ``max``."""

    @staticmethod
    def physical_element_aval(dtype: Any) -> Any:
        return jax.core.ShapedArray((), dtype.float_dtype)

    @staticmethod
    def convert_from(dtype: Any, other: Any) -> bool:
        return dtype.float_dtype == other

    @staticmethod
    def convert_to(other: Any, dtype: Any) -> bool:
        return dtype.float_dtype == other

    @staticmethod
    def add(dtype: Any, x: Any, y: Any) -> Any:
        x, y = (lax.convert_element_type(v, dtype.float_dtype) for v in (x, y))
        return lax.convert_element_type(lax.max(x, y), dtype)

    @staticmethod
    def zero(dtype: Any) -> Any:
        return lax.convert_element_type(np.array(-np.inf, dtype.float_dtype), dtype)

    @staticmethod
    def tangent_dtype(dtype: Any) -> Any:
        return dtype

    @staticmethod
    def full(shape: Any, fill_value: Any, dtype: Any) -> Any:
        fill = lax.convert_element_type(fill_value, dtype.float_dtype)
        return lax.convert_element_type(lax.full(shape, fill, dtype.float_dtype), dtype)

    @staticmethod
    def global_sharded_result_handler(aval: Any, out_sharding: Any, committed: bool) -> Any:
        # Values made outside jit (an eager jax.grad) are arrays of their float32 values.
        physical = _pxla.global_result_handlers[_jax_core.ShapedArray](
            _jax_core.physical_aval(aval), out_sharding, committed
        )
        return lambda buffers: _earray.EArray(aval, physical(buffers))


class _max_combined(_jax_dtypes.extended):  # a dtype kind, named as JAX's are
    pass


@dataclasses.dataclass(frozen=True)
class _MaxCombinedDType(_jax_dtypes.ExtendedDType):
    float_dtype: Any
    _rules: type = _MaxRules
    type: type = _max_combined

    @property
    def name(self) -> str:
        return "fp8_max32"

    def __repr__(self) -> str:
        return self.name


MAX32 = _MaxCombinedDType(FLOAT32)

# Outside jit, JAX adds two cotangents through a table keyed by the array's type, which
# has no entry for an extended dtype's arrays (EArray): add them under jit, by the rules.
_ad_util.raw_jaxval_adders.setdefault(
    _earray.EArray, lambda x, y: jax.jit(_MaxRules.add, static_argnums=0)(x.dtype, x, y)
)


def as_float32(x: Any) -> Any:
    """A max-combined value back in float32 (other values as they are)."""
    return lax.convert_element_type(x, FLOAT32) if x.dtype == MAX32 else x


def as_dtype_of(value: Any, like: Any) -> Any:
    """``value`` max-combined where ``like`` is (as it is otherwise)."""
    return lax.convert_element_type(value, MAX32) if like.dtype == MAX32 else value
