"""``find_nonfinite``: the first operation, forward or backward, that made an inf or a NaN."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxamp._src.numerics import tracing, walk


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """What one value held: dtype, shape, and its range over the finite elements.

    Attributes:
      dtype: e.g. ``"float16"``.
      shape: the array's shape.
      min: the smallest finite element (``nan`` when none is finite).
      max: the largest finite element.
      max_abs: the largest finite magnitude.
      nans: how many elements are NaN.
      infs: how many elements are infinite.
    """

    dtype: str
    shape: tuple[int, ...]
    min: float
    max: float
    max_abs: float
    nans: int
    infs: int

    @classmethod
    def of(cls, x: Any) -> ValueRange:
        a = np.asarray(x)
        if a.dtype.kind == "c":
            a = np.abs(a)
        ok = np.isfinite(a) if a.dtype.kind == "f" else np.ones(a.shape, bool)
        good = a[ok].astype(np.float64) if a.size else np.zeros(0)
        nan = float("nan")
        return cls(
            dtype=np.dtype(a.dtype).name if not hasattr(x, "dtype") else str(x.dtype),
            shape=tuple(a.shape),
            min=float(good.min()) if good.size else nan,
            max=float(good.max()) if good.size else nan,
            max_abs=float(np.abs(good).max()) if good.size else nan,
            nans=int(np.isnan(a).sum()) if a.dtype.kind == "f" else 0,
            infs=int(np.isinf(a).sum()) if a.dtype.kind == "f" else 0,
        )

    def __str__(self) -> str:
        bad = f", {self.nans} NaN, {self.infs} inf" if self.nans or self.infs else ""
        if self.nans + self.infs == int(np.prod(self.shape, dtype=np.int64)):
            return f"{self.dtype}{list(self.shape)}, no finite element ({bad[2:]})"
        return (
            f"{self.dtype}{list(self.shape)} in [{self.min:.4g}, {self.max:.4g}] "
            f"(max |x| {self.max_abs:.4g}{bad})"
        )


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first primitive whose output is non-finite while its inputs are finite.

    Attributes:
      phase: ``"forward"``, ``"backward"`` (computing the gradient), or ``"input"``
        when an argument was already non-finite (``layer`` is then its path).
      layer: the module path from the name stack (``"Model/block/Dense_0"``), ``""``
        outside any named layer.
      primitive: the JAX primitive, e.g. ``"log"``, ``"dot_general"``.
      source: ``file:line (function)`` of the code that traced it.
      inputs: the range of each input.
      output: the range of the first non-finite output.
      iteration: loop iterations it ran in (outermost first), ``()`` outside loops.
      name_stack: the full name stack JAX recorded.
    """

    phase: str
    layer: str
    primitive: str
    source: str
    inputs: tuple[ValueRange, ...]
    output: ValueRange
    iteration: tuple[int, ...] = ()
    name_stack: str = ""

    def __str__(self) -> str:
        where = self.layer or "(no layer)"
        loop = f", loop iteration {list(self.iteration)}" if self.iteration else ""
        lines = [
            f"{self.phase} {self.primitive} in {where}{loop}: output {self.output}",
            *(f"  input {i}: {r}" for i, r in enumerate(self.inputs)),
        ]
        if self.source:
            lines.append(f"  at {self.source}")
        return "\n".join(lines)


def find_nonfinite(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    loss_scale: Any = None,
    grad: bool = True,
) -> Callable[..., NonFinite | None]:
    """Finds the operation that first produced an inf or a NaN in ``fun`` or its gradient.

    ``find_nonfinite(loss_fn)(params, batch)`` traces ``jax.value_and_grad(loss_fn)``
    as the training step does (under the model's policy, ``jaxamp.autocast`` and any
    ``jit`` inside), then evaluates it one primitive at a time on the given values,
    forward pass first, then the gradient's computation. Unlike ``jax_debug_nans`` and
    ``checkify`` it catches infs (how float16 overflow shows), says whether the fault
    is in the forward or the backward pass, and names the layer. A forward fault is
    reported before any backward one, since the forward pass runs first (the forward
    sweep of a gradient also computes derivatives for the backward pass, such as
    ``0.5 / sqrt(x)``: those count as backward). It is a debugging
    tool: slow (one dispatch per primitive), and it takes nothing from a normal step.

    Args:
      fun: the loss, a function returning a floating scalar (``(loss, aux)`` with
        ``has_aux``). NNX modules among its arguments are split: those at ``argnums``
        are differentiated with respect to their ``nnx.Param`` variables, and every
        submodule's operations are named after its path; the modules are not changed.
      argnums: the arguments to differentiate with respect to.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      loss_scale: multiply the loss by this before differentiating, as a loss-scaled
        step does: a number, or an optimizer state holding ``jaxamp.loss_scaled``'s
        (its current scale is used). ``None``: no scaling.
      grad: ``False`` checks the forward pass alone (``fun`` may then return anything).

    Returns:
      A function of ``fun``'s arguments returning ``None`` when every value, forward
      and backward, is finite, else a :class:`NonFinite`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxamp
      >>> def loss(w, x):
      ...     with jax.named_scope("head"):
      ...         return jnp.sum(jnp.sqrt(w * x))
      >>> fault = jaxamp.find_nonfinite(loss)(jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]))
      >>> fault.phase, fault.layer, fault.primitive  # d sqrt(u)/du at u = 0
      ('backward', 'head', 'div')
      >>> jaxamp.find_nonfinite(loss)(jnp.array([1.0, 2.0]), jnp.array([1.0, 1.0])) is None
      True
    """
    scale = _scale_of(loss_scale)

    def find(*args: Any, **kwargs: Any) -> NonFinite | None:
        bad_input = _first_nonfinite_argument(args, kwargs)
        if bad_input is not None:
            return bad_input
        traced = tracing.trace(
            fun, argnums, args, kwargs, has_aux=has_aux, loss_scale=scale, grad=grad
        )
        found: list[NonFinite] = []

        def visit(site: walk.Site, inputs, outputs) -> bool:
            bad = [o for o in outputs if not walk.finite(o)]
            if not bad or not all(walk.finite(i) for i in inputs):
                return False
            if found and site.phase == "backward":
                return False  # a backward fault is already known; a forward one still wins
            found.append(
                NonFinite(
                    phase=site.phase,
                    layer=site.layer,
                    primitive=site.primitive,
                    source=site.source,
                    inputs=tuple(ValueRange.of(i) for i in inputs if hasattr(i, "shape")),
                    output=ValueRange.of(bad[0]),
                    iteration=site.iteration,
                    name_stack=site.name_stack,
                )
            )
            # The forward sweep also computes derivatives the backward pass uses
            # (0.5 / sqrt(x)); they are backward faults, and a forward fault later in
            # the sweep is reported before them: the forward pass runs first.
            return site.phase == "forward"

        walk.run(traced.jaxpr, traced.args, visit, traced.primal_outputs)
        return found[-1] if found else None

    return find


def _scale_of(loss_scale: Any) -> float | None:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, (int, float, np.number)) or (
        hasattr(loss_scale, "shape") and np.shape(loss_scale) == ()
    ):
        value = float(loss_scale)
    else:
        from jaxamp._src.scale_loss import get_loss_scale

        value = float(get_loss_scale(loss_scale))
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"loss_scale must be a positive, finite number, got {loss_scale!r}.")
    return value


def _first_nonfinite_argument(args: Sequence[Any], kwargs: dict[str, Any]) -> NonFinite | None:
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    leaves += jax.tree_util.tree_flatten_with_path(kwargs)[0]
    for path, leaf in leaves:
        if hasattr(leaf, "dtype") and not walk.finite(leaf):
            where = jax.tree_util.keystr(path)
            return NonFinite("input", where, "", "", (), ValueRange.of(leaf), name_stack=where)
    return None
