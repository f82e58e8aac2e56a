"""``range_report``: per layer, how large and how small the values of a step are.

Run it on one calibration batch before committing to float16: it says which
layers' activations or gradients leave float16's range, what fraction would be
subnormal or flush to zero there, and whether float16 with loss scaling is safe
for this model or bfloat16 is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._src.numerics import tracing, walk
from jaxamp._src.numerics.find_nonfinite import _scale_of
from jaxamp._src.policy import Policy, get_policy

_SIXTEEN_BIT = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """The values one layer computed in one phase, over every floating output of its
    operations.

    Attributes:
      layer: the module path (``""``: operations outside any named layer).
      phase: ``"forward"`` (activations) or ``"backward"`` (gradients).
      max_abs: the largest finite magnitude (values at exactly their dtype's largest
        magnitude, the fill of an attention mask, are left out as sentinels).
      size: how many values were seen.
      below_normal: the fraction of the nonzero values below float16's smallest
        normal (6.1e-5): subnormal in float16, with fewer significant bits.
      below_subnormal: the fraction of the nonzero values below half of float16's
        smallest subnormal (6e-8): zero in float16.
      nonfinite: how many values were inf or NaN.
    """

    layer: str
    phase: str
    max_abs: float
    size: int
    below_normal: float
    below_subnormal: float
    nonfinite: int

    def headroom(self, dtype: Any = "float16") -> float:
        """How many times larger the values could grow before they overflow ``dtype``."""
        top = float(jnp.finfo(_dtype(dtype)).max)
        return top / self.max_abs if self.max_abs > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What :meth:`RangeReport.recommend` advises.

    Attributes:
      dtype: ``"float16"`` or ``"bfloat16"``.
      loss_scaling: whether float16 needs loss scaling for the gradients.
      reason: one paragraph saying why, naming the layers.
    """

    dtype: str
    loss_scaling: bool
    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclasses.dataclass(frozen=True)
class RangeReport:
    """Per layer and phase, the range of the values of one evaluation.

    Attributes:
      layers: one :class:`LayerRange` per (layer, phase), in the order first seen.
      loss_scale: the scale the loss was multiplied by before differentiating.
      policy: the policy the values were read under (only the values it holds in 16
        bits are counted), or ``None``: every value of ``fun`` as written.
    """

    layers: tuple[LayerRange, ...]
    loss_scale: float | None = None
    policy: str | None = None

    def overflows(self, dtype: Any = "float16") -> list[LayerRange]:
        """The layers whose values exceed ``dtype``'s largest finite value (65504 for
        float16), or were already inf or NaN."""
        top = float(jnp.finfo(_dtype(dtype)).max)
        return [r for r in self.layers if r.max_abs > top or r.nonfinite]

    def recommend(self, underflow_threshold: float = 1e-3) -> Recommendation:
        """Whether float16 with loss scaling is safe for this model and batch.

        * An activation beyond float16's range: bfloat16 (loss scaling cannot help the
          forward pass).
        * A gradient beyond it at the loss scale used: bfloat16 (float16 would need a
          loss scale below 1, i.e. gradients that do not fit float16 even unscaled).
        * Else float16; with loss scaling when more than ``underflow_threshold`` of
          some layer's nonzero gradients would flush to zero.
        """
        scale = self.loss_scale or 1.0
        for phase, what, after in (
            ("forward", "activations", "Loss scaling does not change the forward pass."),
            ("backward", "gradients", f"That is at loss scale {scale:g}."),
        ):
            rows = [r for r in self.overflows() if r.phase == phase]
            if rows:
                worst = max(rows, key=lambda r: r.max_abs)
                return Recommendation(
                    "bfloat16",
                    False,
                    f"Use bfloat16: {what} of {_names(rows)} exceed float16's range "
                    f"(largest {worst.max_abs:.3g} in {worst.layer or '(no layer)'}, float16 "
                    f"stops at 65504). {after}",
                )
        grads = [r for r in self.layers if r.phase == "backward"]
        flushed = [r for r in grads if r.below_subnormal > underflow_threshold]
        if flushed:
            worst = max(flushed, key=lambda r: r.below_subnormal)
            return Recommendation(
                "float16",
                True,
                "float16 is safe with loss scaling: every value fits its range, but "
                f"{worst.below_subnormal:.1%} of the nonzero gradients of "
                f"{worst.layer or '(no layer)'} would flush to zero unscaled "
                "(use jaxamp.loss_scaled with DynamicLossScale).",
            )
        headroom = min((r.headroom() for r in self.layers), default=float("inf"))
        return Recommendation(
            "float16",
            any(r.below_normal > underflow_threshold for r in grads),
            "float16 is safe: every activation and gradient fits float16's range "
            f"(the nearest comes within a factor {headroom:.3g} of 65504) and no layer's "
            "gradients flush to zero; keep dynamic loss scaling to stay safe as they shrink.",
        )

    def table(self) -> str:
        """A text table, one row per layer: max |activation|, max |gradient| and the
        gradients' fractions below float16's smallest normal and subnormal."""
        rows = [("layer", "max |act|", "max |grad|", "grad < f16 normal", "grad < f16 subnormal")]
        by_layer: dict[str, dict[str, LayerRange]] = {}
        for r in self.layers:
            by_layer.setdefault(r.layer, {})[r.phase] = r
        for layer, phases in by_layer.items():
            fwd, bwd = phases.get("forward"), phases.get("backward")
            rows.append(
                (
                    layer or "(no layer)",
                    f"{fwd.max_abs:.3g}" if fwd else "-",
                    f"{bwd.max_abs:.3g}" if bwd else "-",
                    f"{bwd.below_normal:.2%}" if bwd else "-",
                    f"{bwd.below_subnormal:.2%}" if bwd else "-",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        )


def _names(rows: Sequence[LayerRange]) -> str:
    names = list(dict.fromkeys(r.layer or "(no layer)" for r in rows))
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _dtype(dtype: Any) -> Any:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _SIXTEEN_BIT:
        raise ValueError(f"dtype must be one of {', '.join(_SIXTEEN_BIT)}, got {dtype!r}.")
    return jnp.dtype(name)


class _Accumulator:
    """Running statistics of one (layer, phase)."""

    def __init__(self):
        self.max_abs, self.size, self.nonzero = 0.0, 0, 0
        self.below_normal, self.below_subnormal, self.nonfinite = 0, 0, 0

    def add(self, x: Any) -> None:
        raw = np.asarray(x)
        a = np.abs(raw.astype(np.float64)).ravel()
        if raw.dtype.kind == "f":
            # a value at exactly its dtype's largest magnitude is a sentinel, not data: the
            # -finfo.max an attention mask fills in, which follows the compute dtype
            a = a[a != float(np.finfo(raw.dtype).max)]
        ok = np.isfinite(a)
        self.nonfinite += int(a.size - ok.sum())
        a = a[ok]
        self.size += a.size
        if a.size:
            self.max_abs = max(self.max_abs, float(a.max()))
        nonzero = a[a > 0]
        self.nonzero += nonzero.size
        tiny = float(jnp.finfo(jnp.float16).tiny)  # smallest normal, 2**-14
        self.below_normal += int((nonzero < tiny).sum())
        self.below_subnormal += int((nonzero < 2.0**-25).sum())  # rounds to 0 in float16

    def result(self, layer: str, phase: str) -> LayerRange:
        n = max(self.nonzero, 1)
        return LayerRange(
            layer,
            phase,
            self.max_abs,
            self.size,
            self.below_normal / n,
            self.below_subnormal / n,
            self.nonfinite,
        )


def range_report(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    loss_scale: Any = None,
    policy: Any = None,
) -> Callable[..., RangeReport]:
    """Per layer, the largest |activation| and |gradient| of one step, and how many
    values float16 could not hold.

    ``jaxamp.range_report(loss_fn)(params, batch)`` evaluates the loss and its gradient
    as :func:`jaxamp.find_nonfinite` does (one primitive at a time, under the model's
    own policy) and records every floating value each layer computes. Run the model
    in float32 (or bfloat16) on one calibration batch to learn whether float16 will
    hold it; ``.overflows("float16")`` lists the layers that exceed 65504 and
    ``.recommend()`` says whether float16 with loss scaling is safe or bfloat16 is
    needed. It counts every value a layer computes, intermediates included (a policy
    may keep some in float32, such as the cube inside tanh-GELU). Slow; for
    debugging, not for training steps.

    Args:
      fun: the loss (a floating scalar; ``(loss, aux)`` with ``has_aux``).
      argnums: what the gradient is taken with respect to.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      loss_scale: a number or an optimizer state with ``jaxamp.loss_scaled``: the
        gradients are those of the loss times this scale, as float16 would see them.
      policy: the mixed-precision policy you mean to train with (a
        :class:`jaxamp.Policy` or its string: ``fun`` runs under ``jaxamp.autocast``),
        or the mixed-precision version of ``fun`` itself. Then only the values that
        policy computes in 16 bits are counted, each computed in float32 so that its
        size shows: LayerNorm statistics, softmax and the other work a policy keeps
        in float32 cannot overflow float16 and are left out. ``None`` (default): every
        value of ``fun`` as it runs.

    Returns:
      A function of ``fun``'s arguments returning a :class:`RangeReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> def loss(w, x):
      ...     with jax.named_scope("big"):
      ...         h = x @ w
      ...     return jnp.mean(h**2)
      >>> report = jaxamp.range_report(loss)(jnp.full((4, 4), 3e4), jnp.ones((2, 4)))
      >>> sorted({(r.layer, r.phase) for r in report.overflows("float16")})
      [('', 'backward'), ('', 'forward'), ('big', 'forward')]
      >>> report.recommend().dtype
      'bfloat16'
    """
    scale = _scale_of(loss_scale)
    target, described = fun, None
    if isinstance(policy, (Policy, str)):
        from jaxamp._src.autocast import autocast

        target, described = autocast(fun, policy), str(get_policy(policy))
    elif policy is not None:
        if not callable(policy):
            raise TypeError(
                "policy must be a jaxamp.Policy, a policy string or the mixed-precision "
                f"version of fun, got {type(policy).__name__}: {policy!r}."
            )
        target, described = policy, getattr(policy, "__name__", "the mixed-precision fun")

    def report(*args: Any, **kwargs: Any) -> RangeReport:
        traced = tracing.trace(target, argnums, args, kwargs, has_aux=has_aux, loss_scale=scale)
        stats: dict[tuple[str, str], _Accumulator] = {}

        def visit(site: walk.Site, inputs, outputs) -> None:
            for out, sixteen in zip(outputs, site.sixteen_bit, strict=True):
                if walk.is_floating(out) and (sixteen or described is None):
                    stats.setdefault((site.layer, site.phase), _Accumulator()).add(out)

        walk.run(
            traced.jaxpr, traced.args, visit, traced.primal_outputs, widen=described is not None
        )
        layers = tuple(acc.result(layer, phase) for (layer, phase), acc in stats.items())
        return RangeReport(layers, scale, described)

    return report
