"""What ``range_report`` measures and what it advises: ``LayerRange`` per layer and
phase, ``RangeReport`` over a step, and its ``Recommendation``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._src.dtypes import SIXTEEN_BIT_NAMES
from jaxamp._src.errors import invalid_choice


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
      below_normal: the fraction of the nonzero values that float16 holds below its
        smallest normal (6.1e-5), as subnormals with fewer significant bits, or as 0.
      below_subnormal: the fraction of the nonzero values that float16 rounds to zero:
        those up to half its smallest subnormal, 2**-25 (about 3e-8) included.
      nonfinite: how many values were inf or NaN.
      nonfinite_float32: how many of those float32 makes too, so that float16's range
        is not at fault: each inf and NaN is followed to the operation that made it,
        which holds its output in float32 (or computes it there, for a policy), or is
        not finite computed in float32 either (``log(0)`` in float16), or was fed an
        inf constant that is not float16 (a ``-inf`` mask fill; a float16 inf may be
        a value float16 rounded, such as a mask of ``1e30``, and counts as float16's).
    """

    layer: str
    phase: str
    max_abs: float
    size: int
    below_normal: float
    below_subnormal: float
    nonfinite: int
    nonfinite_float32: int = 0

    def headroom(self, dtype: Any = "float16") -> float:
        """How many times larger the values could grow before they overflow ``dtype``."""
        top = float(jnp.finfo(_dtype(dtype)).max)
        return top / self.max_abs if self.max_abs > 0 else float("inf")

    def overflows(self, dtype: Any = "float16") -> bool:
        """Whether ``dtype`` cannot hold these values: the largest rounds to inf there
        (float16 holds up to 65504 and rounds values below 65520 to it), or some were
        inf or NaN in a 16-bit type already."""
        return _rounds_to_inf(self.max_abs, dtype) or self.nonfinite > self.nonfinite_float32


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What ``RangeReport.recommend`` advises.

    Attributes:
      dtype: ``"float16"`` or ``"bfloat16"``.
      loss_scaling: whether float16 needs loss scaling for the gradients.
      reason: one paragraph saying why, naming the layers.
      loss_scale: when the loss scale the report was made at overflows float16's
        gradients but a smaller one fits them: the largest power of two that does
        (from this batch); else ``None``.
      nonfinite: the layers that make inf or NaN in float32 too, which no 16-bit type
        changes (a mask's ``-inf`` fill is harmless; ``jaxamp.find_nonfinite`` tells
        whether one reaches the loss or the gradients), in the order the program first
        computes them.
    """

    dtype: str
    loss_scaling: bool
    reason: str
    loss_scale: float | None = None
    nonfinite: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.reason


@dataclasses.dataclass(frozen=True)
class RangeReport:
    """Per layer and phase, the range of the values of one evaluation.

    Attributes:
      layers: one ``LayerRange`` per (layer, phase), in the order first seen.
      loss_scale: the scale the loss was multiplied by before differentiating (the
        multiplication itself is not counted: it is not a value of the model).
      policy: the policy the values were read under (only the values it holds in 16
        bits are counted), or ``None``: every value of ``fun`` as written.
      unscaled: when some gradient overflowed float16 at ``loss_scale`` (above 1): the
        gradients' rows evaluated again at loss scale 1, so that ``recommend``
        tells a loss scale too large from gradients float16 cannot hold.
      nonfinite: ``(layer, phase)`` of the rows holding inf or NaN, in the order the
        program first made one there.
      forward_only: why no gradient was taken (``"the function returns a
        non-scalar"``), ``""`` when it was: then only activations were measured.
    """

    layers: tuple[LayerRange, ...]
    loss_scale: float | None = None
    policy: str | None = None
    unscaled: tuple[LayerRange, ...] = ()
    nonfinite: tuple[tuple[str, str], ...] = ()
    forward_only: str = ""

    def overflows(self, dtype: Any = "float16") -> list[LayerRange]:
        """The layers whose values ``dtype`` cannot hold (``LayerRange.overflows``):
        whose largest magnitude rounds to inf there (float16 holds up to 65504, and
        rounds values below 65520 to it), or that were already inf or NaN in a 16-bit
        type. Values inf or NaN in float32 too (a ``-inf`` mask fill, ``log(0)``) are
        not ``dtype``'s range at fault and do not count (``nonfinite`` lists them)."""
        return [r for r in self.layers if r.overflows(dtype)]

    def recommend(self, underflow_threshold: float = 1e-3) -> Recommendation:
        """Whether float16 with loss scaling is safe for this model and batch.

        * An activation beyond float16's range: bfloat16 (loss scaling cannot help the
          forward pass).
        * A gradient beyond it at the loss scale used, which fits unscaled: float16
          with a smaller loss scale, the largest power of two that fits
          (``Recommendation.loss_scale``).
        * A gradient beyond it even unscaled: bfloat16 (float16 would need a loss scale
          below 1).
        * Else float16; with loss scaling when more than ``underflow_threshold`` of
          some layer's nonzero gradients would flush to zero.

        Values that are inf or NaN in float32 too (``log(0)``, a fully masked softmax
        row) are not float16's range at fault and decide nothing; the reason names
        their layers (``Recommendation.nonfinite``).
        """
        advice = self._advice(underflow_threshold)
        rows = {(r.layer, r.phase): r for r in self.layers}
        wide = [k for k in self.nonfinite if k in rows and rows[k].nonfinite_float32]
        layers = tuple(dict.fromkeys(layer for layer, _ in wide))
        notes = [advice.reason]
        if layers:
            count = sum(rows[k].nonfinite_float32 for k in wide)
            notes.append(
                f"Note: {count} values of {_names([rows[k] for k in wide])} are inf or NaN "
                "in float32 too, which no 16-bit type changes (a mask's -inf fill is "
                "harmless; jaxamp.find_nonfinite names the operation that makes them and "
                "whether they reach the loss or the gradients)."
            )
        if self.forward_only:
            notes.append(
                f"forward only: {self.forward_only}, so no gradient was taken: this covers "
                "the activations alone."
            )
        return dataclasses.replace(advice, reason=" ".join(notes), nonfinite=layers)

    def _advice(self, underflow_threshold: float) -> Recommendation:
        scale = self.loss_scale or 1.0
        forward = [r for r in self.layers if r.phase == "forward" and beyond_float16(r)]
        if forward:
            return Recommendation(
                "bfloat16",
                False,
                f"Use bfloat16: activations of {_names(forward)} exceed float16's range "
                f"({_beyond_text(forward)}). Loss scaling does not change the forward pass.",
            )
        backward = [r for r in self.layers if r.phase == "backward" and beyond_float16(r)]
        if backward:
            fitting = self._smaller_scale(backward)
            if fitting is not None:
                return fitting
            unscaled = ", and unscaled too" if self.unscaled and scale > 1 else ""
            return Recommendation(
                "bfloat16",
                False,
                f"Use bfloat16: gradients of {_names(backward)} exceed float16's range "
                f"({_beyond_text(backward)}). That is at loss scale {scale:g}{unscaled}.",
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

    def _smaller_scale(self, rows: Sequence[LayerRange]) -> Recommendation | None:
        """float16 with the largest power-of-two loss scale below this one at which the
        gradients of ``rows`` fit, if they fit unscaled: each grows at most in
        proportion to the scale."""
        scale = self.loss_scale or 1.0
        if scale <= 1 or not self.unscaled or any(beyond_float16(r) for r in self.unscaled):
            return None
        unscaled = {r.layer: r for r in self.unscaled}
        top = float(jnp.finfo(jnp.float16).max)
        limits = [top / unscaled[r.layer].max_abs for r in rows if r.layer in unscaled]
        bound = min([scale / 2, *(x for x in limits if x > 0)])
        fit = 2.0 ** math.floor(math.log2(bound))
        if fit < 1:
            return None
        largest = max((unscaled[r.layer].max_abs for r in rows if r.layer in unscaled), default=0)
        return Recommendation(
            "float16",
            True,
            f"float16 with a smaller loss scale: at loss scale {scale:g} the gradients of "
            f"{_names(rows)} exceed float16's range ({_beyond_text(rows)}), but unscaled "
            f"they fit (largest {largest:.3g}): a loss scale of {fit:g} (2**"
            f"{int(math.log2(fit))}) or less keeps them in range. jaxamp.DynamicLossScale "
            "backs off to such a scale after overflowing steps; start it there "
            f"(init_scale={fit:g}), or use jaxamp.StaticLossScale({fit:g}).",
            loss_scale=fit,
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
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        if self.forward_only:
            lines.append(f"forward only: {self.forward_only}, so no gradient was taken")
        return "\n".join(lines)


def beyond_float16(r: LayerRange) -> bool:
    """Whether float16 cannot hold a row's values: the largest rounds to inf there, or
    some were inf or NaN in 16 bits already (non-finite float32 values do not count:
    float16 is not their cause)."""
    return _rounds_to_inf(r.max_abs, "float16") or r.nonfinite > r.nonfinite_float32


def _beyond_text(rows: Sequence[LayerRange]) -> str:
    worst = max(rows, key=lambda r: r.max_abs)
    parts = []
    if _rounds_to_inf(worst.max_abs, "float16"):
        parts.append(
            f"largest {worst.max_abs:.3g} in {worst.layer or '(no layer)'}, float16 stops at 65504"
        )
    sixteen = [r for r in rows if r.nonfinite > r.nonfinite_float32]
    if sixteen:
        count = sum(r.nonfinite - r.nonfinite_float32 for r in sixteen)
        parts.append(f"{count} values already inf or NaN in 16 bits, in {_names(sixteen)}")
    return "; ".join(parts)


def _rounds_to_inf(value: float, dtype: Any) -> bool:
    """Whether ``dtype`` (float16 or bfloat16) rounds ``value`` to inf."""
    with np.errstate(over="ignore"):
        return bool(np.isinf(np.asarray(value, np.float64).astype(_dtype(dtype))))


def _names(rows: Sequence[LayerRange]) -> str:
    names = list(dict.fromkeys(r.layer or "(no layer)" for r in rows))
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _dtype(dtype: Any) -> Any:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in SIXTEEN_BIT_NAMES:
        raise invalid_choice("dtype", dtype, ("float16", "bfloat16"))
    return jnp.dtype(name)
