"""What a checkpoint conversion did, leaf by leaf: the report and its refusal."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Conversion(NamedTuple):
    """One leaf a conversion (``convert_state``, ``convert_fp8_state``) changed.

    Attributes:
      path: where the leaf is in the result (``params['dense']['kernel']``,
        ``opt_state.inner_state[0].mu['dense']['kernel']``), or, for a leaf dropped, where
        it was in the saved state.
      action: ``"cast"`` (to another dtype), ``"created"`` (the target's fresh value: the
        saved state had none), ``"dropped"`` (the target has no place for it),
        ``"derived"`` (computed from the saved weights: a master, a compensation) or
        ``"resized"`` (the loss scale's history).
      detail: what it came from or why, in a few words.
      max_abs_error: the largest absolute change of what the leaf stands for (the weight
        a param, its master and its compensation represent together; a moment's
        value), in float64; ``0.0`` when exact.
      max_rel_error: the same relative to the saved value (over its non-zero elements).
    """

    path: str
    action: str
    detail: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0

    @property
    def lossless(self) -> bool:
        return self.max_abs_error == 0.0


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What a conversion did: every leaf it did not keep as saved, bit for bit.

    Attributes:
      rows: one ``Conversion`` per leaf cast, created, dropped, derived or resized.
      kept: how many leaves were kept as saved.
    """

    rows: tuple[Conversion, ...]
    kept: int

    @property
    def lossless(self) -> bool:
        """Whether the result holds every weight and statistic the saved state held."""
        return all(r.lossless for r in self.rows)

    def lossy(self) -> tuple[Conversion, ...]:
        """The rows that changed a value."""
        return tuple(r for r in self.rows if not r.lossless)

    def worst(self) -> Conversion | None:
        """The row with the largest relative error (``None`` when all are exact)."""
        lossy = self.lossy()
        return max(lossy, key=lambda r: r.max_rel_error) if lossy else None

    def __str__(self) -> str:
        head = f"{self.kept} leaves kept as saved; {len(self.rows)} changed"
        if not self.rows:
            return head + "."
        lines = [head + ":"]
        for r in self.rows:
            error = (
                ""
                if r.lossless
                else f" (max error {r.max_abs_error:.3g}, rel. {r.max_rel_error:.3g})"
            )
            lines.append(f"  {r.action:8s} {r.path}: {r.detail}{error}")
        return "\n".join(lines)


class LossyConversionError(ValueError):
    """A conversion that would change a value, refused (``allow_lossy=False``)."""

    def __init__(self, report: ConversionReport, what: str = "convert_state"):
        self.report = report
        rows = report.lossy()
        worst = report.worst()
        assert worst is not None
        super().__init__(
            f"{what} would change {len(rows)} value(s), the largest relative change "
            f"{worst.max_rel_error:.3g} at {worst.path} ({worst.detail}). Pass "
            "allow_lossy=True to accept it; the error's .report lists every change."
        )


def errors(saved: np.ndarray, now: np.ndarray) -> tuple[float, float]:
    """Largest absolute and relative change, 0 where both are the same value (NaNs too)."""
    if saved.size == 0:
        return 0.0, 0.0
    same = (saved == now) | (np.isnan(saved) & np.isnan(now))
    diff = np.where(same, 0.0, np.abs(saved - now))
    diff = np.where(np.isnan(diff), np.inf, diff)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(saved))
    return float(diff.max()), float(np.nan_to_num(rel, nan=np.inf).max())


class Rows:
    def __init__(self) -> None:
        self.rows: list[Conversion] = []
        self.kept = 0

    """The report's rows as a conversion finds them, and how many leaves it kept."""

    def add(
        self, path: str, action: str, detail: str, errors: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        self.rows.append(Conversion(path, action, detail, *errors))
