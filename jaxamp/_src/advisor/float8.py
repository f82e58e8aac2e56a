"""What a float8 GEMM would flush: per layer, the share of a GEMM operand's nonzero values
below float8 e4m3's range once scaled per tensor from its largest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._src.dtypes import is_inexact_array
from jaxamp._src.numerics import evaluator, sites, tracing

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
# Half e4m3's smallest subnormal (2^-9): a scaled value below it rounds to zero.
E4M3_FLUSH = 2.0**-10


def flushed_shares(fun: Callable[..., Any], args: Sequence[Any]) -> dict[str, float]:
    """Per layer, the largest share, over its forward GEMMs' two operands, of nonzero values
    that current per-tensor scaling (the operand's largest magnitude mapped to e4m3's 448)
    would round to zero, read from ``fun`` run as written on ``args``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def loss(w, x):
      ...     with jax.named_scope("first"):
      ...         return jnp.mean(x @ w)
      >>> x = jnp.ones((4, 8)).at[0, 0].set(1e6)  # one outlier: the rest scale below e4m3
      >>> round(flushed_shares(loss, (jnp.ones((8, 2)), x))["first"], 2)
      0.97
    """
    traced = tracing.trace(fun, 0, tuple(args), {})
    layers: list[str] = []  # in the order the shares are made, kept apart from jit's outputs

    def collect(values: Sequence[Any]) -> list[Any]:
        shares: list[Any] = []

        def visit(site: sites.Site, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
            if site.primitive != "dot_general" or site.phase != "forward":
                return
            for x in inputs[:2]:
                if not is_inexact_array(x):
                    continue
                magnitude = jnp.abs(x.astype(jnp.float32))
                tiny = jnp.max(magnitude) / E4M3_MAX * E4M3_FLUSH
                nonzero = jnp.sum(magnitude > 0)
                flushed = jnp.sum((magnitude > 0) & (magnitude < tiny))
                layers.append(site.layer)
                shares.append(flushed / jnp.maximum(nonzero, 1))

        evaluator.run(traced.jaxpr, values, visit, traced.primal_outputs)
        return shares

    if evaluator.stageable(traced.jaxpr):
        shares = jax.jit(collect)(list(traced.args))
    else:
        shares = collect(traced.args)
    result: dict[str, float] = {}
    for layer, share in zip(layers, shares, strict=True):
        result[layer] = max(result.get(layer, 0.0), float(share))
    return result
