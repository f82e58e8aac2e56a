"""``precision_report``: every matmul and convolution of a lowered or compiled program, with
its dtypes, pass and layer, beside its sensitive operations and its converts."""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxamp._src.audit.checks import (
    PrecisionError,
    SensitiveOp,
    canonical_dtype_name,
    find_problems,
    read_lowered,
    short_name,
)
from jaxamp._src.audit.hlo import read_compiled, wider_result
from jaxamp._src.jaxprs import BLOCK_SCOPE_PREFIX


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """One matmul or convolution in a program.

    Attributes:
      kind: ``"dot_general"`` or ``"convolution"`` (``"custom-call"`` for a
        cuBLAS/cuDNN call in a compiled GPU program).
      lhs_dtype: dtype of the left operand (numpy name, e.g. ``"bfloat16"``).
      rhs_dtype: dtype of the right operand.
      result_dtype: dtype of the result.
      accumulation_dtype: the accumulation dtype where the program states it (a
        dot algorithm, or a result wider than the operands), else ``None``.
      lhs_shape: shape of the left operand.
      rhs_shape: shape of the right operand.
      name: the source name JAX recorded (e.g. ``jit(step)/jvp(ResNet)/Conv_0/...``).
      direction: ``"forward"``, ``"backward"`` or ``"unknown"``.
      executions: how many times it runs per call of the program (a ``scan``'s
        length and repeated calls of a nested ``jit`` multiply), ``None`` inside
        a loop of unknown trip count or where the report was read from text.
      contracts: whether it sums over a contracting dimension (an einsum such as
        ``"...hqk,h->...hqk"`` only multiplies).
      upcast: whether the program converts both 16-bit operands to float32 for a
        float32 GEMM (jaxamp's ``upcast`` matmul form, for backends without 16-bit
        GEMM kernels); ``lhs_dtype`` and ``rhs_dtype`` then name the 16-bit dtype
        the values come in, and ``accumulation_dtype`` is float32.
      float8: whether it is a float8 GEMM of jaxamp's rule (traced in its
        ``jaxamp_fp8`` scope, or on float8 operands). A compiled CPU program computes
        it on float32 copies of the float8 values, and its operands read float32 there.
    """

    kind: str
    lhs_dtype: str
    rhs_dtype: str
    result_dtype: str
    accumulation_dtype: str | None
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    name: str = ""
    direction: str = "unknown"
    executions: int | None = None
    contracts: bool = True
    upcast: bool = False
    float8: bool = False

    @property
    def layer(self) -> str:
        """The layer path, e.g. ``"ResNet/Conv_0"``."""
        return short_name(self.name)

    @property
    def block_format(self) -> str | None:
        """The block-scaled format of a block-scaled GEMM of jaxamp's rule (``"mxfp8"``,
        ``"nvfp4"``), read from its scope; ``None`` for any other. Its operands read
        float32 (the emulation multiplies each block's values by their scale first)."""
        match = re.search(re.escape(BLOCK_SCOPE_PREFIX) + r"([a-z0-9]+)", self.name)
        return match.group(1) if match and self.float8 else None

    @property
    def float8_operands(self) -> bool:
        """Whether an operand is in a float8 dtype in the program read."""
        return self.lhs_dtype.startswith("float8") or self.rhs_dtype.startswith("float8")

    @property
    def operand_dtype(self) -> str:
        """The operands' dtype, or ``"lhs/rhs"`` when they differ."""
        if self.lhs_dtype == self.rhs_dtype:
            return self.lhs_dtype
        return f"{self.lhs_dtype}/{self.rhs_dtype}"


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The matmuls, convolutions and converts of one program.

    Each operation of the program is listed once, with ``executions``: how many
    times it runs per call. The report also lists the numerically sensitive
    operations (``sensitive``) and can be audited with ``problems`` and
    ``check``.

    Attributes:
      ops: every matmul and convolution, in program order.
      converts: number of converts from one floating type to another (in the program).
      source: ``"stablehlo"`` (lowered) or ``"hlo"`` (compiled).
      sensitive: the exponentials, logarithms, square roots, ``erf``, reductions,
        pooling sums, cumulative sums, scatter-adds and all-reduces
        (``jaxamp.debug.SensitiveOp``), read from the lowered program or, for a
        compiled report, from the compiled HLO in the dtype it computes them in
        (their ``executions`` then unknown).
    """

    ops: tuple[MatmulOp, ...]
    converts: int
    source: str
    sensitive: tuple[SensitiveOp, ...] = ()

    @classmethod
    def from_text(cls, text: str) -> PrecisionReport:
        """Parses compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

        Lowered StableHLO is read from the program itself, not from its text: use
        ``from_lowered`` (or ``jaxamp.precision_report``).

        Raises:
          ValueError: for StableHLO text.
        """
        if "stablehlo." in text or "func.func" in text:
            raise ValueError(
                "PrecisionReport.from_text reads compiled HLO text; for lowered StableHLO "
                "use PrecisionReport.from_lowered(jax.jit(f).lower(*args)) or "
                "jaxamp.precision_report(f)(*args)."
            )
        return _from_compiled(text)

    @classmethod
    def from_lowered(cls, lowered: Any, compiled: bool = False) -> PrecisionReport:
        """Reads a ``jax.stages.Lowered``: its StableHLO, or its compiled HLO."""
        if compiled:
            return _from_compiled(lowered.compile().as_text())
        matmuls, sensitive, converts = read_lowered(lowered.compiler_ir("stablehlo"))
        ops = tuple(MatmulOp(**fields) for fields in matmuls)
        for op in ops:
            if op.accumulation_dtype is None:
                wider = wider_result(op.lhs_dtype, op.rhs_dtype, op.result_dtype)
                object.__setattr__(op, "accumulation_dtype", wider)
        return cls(ops, converts, "stablehlo", tuple(sensitive))

    def problems(self, compute_dtype: Any = None, *, ignore: Sequence[str] = ()) -> list:
        """The precision problems of the program, each naming its primitive, dtype and layer.

        * a sensitive operation (``exp``, ``log``, ``sqrt``, ``erf``, sums, products,
          cumulative sums...) computed in a 16-bit type (max and min are exact in
          any dtype and are not problems);
        * where ``compute_dtype`` is a 16-bit dtype, a matmul or convolution on
          float32 operands (the silent upcast of ``x @ self.param(...)``);
        * a matmul or convolution on 16-bit operands with a 16-bit result and no
          wider accumulation stated.

        Args:
          compute_dtype: the policy's compute dtype, or ``None`` not to look for
            float32 matmuls.
          ignore: layer path patterns (globs, as in ``apply_policy``'s overrides,
            e.g. ``"head"``) whose problems are expected, such as a layer kept
            in float32 on purpose.

        Returns:
          A list of ``jaxamp.debug.Problem``; empty when the program is clean.
        """
        return find_problems(self, compute_dtype, tuple(ignore))

    def check(self, compute_dtype: Any = None, *, ignore: Sequence[str] = ()) -> PrecisionReport:
        """Raises ``jaxamp.debug.PrecisionError`` listing ``problems``; returns ``self``.

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import jaxamp
          >>> x = jnp.ones((4, 8), jnp.bfloat16)
          >>> jaxamp.precision_report(jax.nn.softmax)(x).check()
          Traceback (most recent call last):
          ...
          jaxamp.debug.PrecisionError: 1 precision problem(s):
            - exp computed in bfloat16 at <top level> (forward, runs 1x)
          >>> report = jaxamp.precision_report(jaxamp.autocast(jax.nn.softmax))(x).check()
          >>> sorted({(op.primitive, op.dtype) for op in report.sensitive})
          [('exp', 'float32'), ('reduce_max', 'float32'), ('reduce_sum', 'float32')]
        """
        problems = self.problems(compute_dtype, ignore=ignore)
        if problems:
            raise PrecisionError(problems)
        return self

    def executed(self, operand_dtype: str | None = None) -> int | None:
        """Matmuls and convolutions run per call (``None`` if a loop's trip count is
        unknown), optionally only those with both operands in ``operand_dtype``."""
        total = 0
        for op in self.ops:
            if operand_dtype is None or op.operand_dtype == canonical_dtype_name(operand_dtype):
                if op.executions is None:
                    return None
                total += op.executions
        return total

    def count(self, operand_dtype: str | None = None, kind: str | None = None) -> int:
        """Number of ops, optionally with both operands in ``operand_dtype``, of ``kind``."""
        return sum(
            1
            for op in self.ops
            if (operand_dtype is None or op.operand_dtype == canonical_dtype_name(operand_dtype))
            and (kind is None or op.kind == kind)
        )

    def all_operands_in(self, dtype: Any) -> bool:
        """Whether there is at least one op and every op's operands are in ``dtype``."""
        return bool(self.ops) and self.count(dtype) == len(self.ops)

    def by_dtype(self) -> dict[str, int]:
        """``{operand dtype: number of ops}``."""
        return dict(collections.Counter(op.operand_dtype for op in self.ops))

    @property
    def reads(self) -> str:
        """Which program the report read: the lowered one states what the program asks for
        (a float8 GEMM's float8 operands), the compiled one what the backend runs."""
        if self.source == "stablehlo":
            return "lowered StableHLO: the dtypes the program asks for"
        return "compiled HLO: what this backend runs"

    def float8_gemms(self) -> tuple[int, int]:
        """``(float8 GEMMs, those on float8 operands in the program read)``: in a compiled
        CPU program the second is 0 (XLA:CPU converts the operands to float32); in the
        lowered program, or compiled for a GPU with float8 GEMMs, the two are equal."""
        ops = [op for op in self.ops if op.float8]
        return len(ops), sum(op.float8_operands for op in ops)

    def block_gemms(self) -> dict[str, int]:
        """The block-scaled GEMMs, counted by format (``{"mxfp8": 6}``)."""
        return dict(collections.Counter(op.block_format for op in self.ops if op.block_format))

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        float8, in_float8 = self.float8_gemms()
        return {
            "source": self.source,
            "reads": self.reads,
            "float8_gemms": float8,
            "float8_gemms_on_float8_operands": in_float8,
            "block_scaled_gemms": self.block_gemms(),
            "matmuls": len(self.ops),
            "by_operand_dtype": self.by_dtype(),
            "accumulation": dict(
                collections.Counter(str(op.accumulation_dtype) for op in self.ops)
            ),
            "converts": self.converts,
            "executed": self.executed(),
            "sensitive": dict(
                collections.Counter(f"{op.primitive}:{op.dtype}" for op in self.sensitive)
            ),
        }

    def __str__(self) -> str:
        header = ("kind", "pass", "operands", "result", "accumulate", "runs", "lhs shape", "layer")
        rows = [header] + [
            (
                op.kind,
                op.direction,
                op.operand_dtype,
                op.result_dtype,
                op.accumulation_dtype or "backend",
                "?" if op.executions is None else op.executions,
                "x".join(map(str, op.lhs_shape)),
                short_name(op.name),
            )
            for op in self.ops
        ]
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.append(
            f"{len(self.ops)} matmuls/convolutions by operand dtype {self.by_dtype()}; "
            f"{self.converts} floating converts ({self.source})"
        )
        float8, in_float8 = self.float8_gemms()
        if float8:
            lines.append(
                f"{float8} float8 GEMMs, {in_float8} of them on float8 operands in this "
                f"program ({self.reads})"
            )
        if self.block_gemms():
            formats = ", ".join(f"{n} {name}" for name, n in self.block_gemms().items())
            lines.append(f"block-scaled GEMMs among them: {formats}")
        if self.sensitive:
            counts = collections.Counter(f"{op.primitive} {op.dtype}" for op in self.sensitive)
            lines.append(
                "sensitive operations: " + ", ".join(f"{k} x{n}" for k, n in counts.items())
            )
        return "\n".join(lines)


def _from_compiled(text: str) -> PrecisionReport:
    matmuls, sensitive, converts = read_compiled(text)
    ops = tuple(MatmulOp(**fields) for fields in matmuls)
    return PrecisionReport(ops, converts, "hlo", tuple(sensitive))


def precision_report(
    fun: Callable[..., Any],
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    compiled: bool = False,
) -> Callable[..., PrecisionReport]:
    """Returns a function that lowers ``fun`` for the given arguments and reports its matmuls.

    Used like ``jax.make_jaxpr``: ``precision_report(step)(params, batch)``.

    Args:
      fun: a function, or an already ``jax.jit``-ed one (its ``lower`` is used).
      static_argnums: static positional arguments, as for ``jax.jit``.
      static_argnames: static keyword arguments, as for ``jax.jit``.
      compiled: report the compiled HLO instead of the lowered StableHLO: what the
        backend runs (on CPU, XLA computes 16-bit matmuls and bfloat16
        elementwise math in float32; see the Precision audit guide,
        guides/precision-audit.md).

    Returns:
      A function taking ``fun``'s arguments and returning a ``PrecisionReport``.

    Examples:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((2, 2), jnp.bfloat16)
      >>> report = precision_report(jnp.matmul)(x, x)
      >>> report.all_operands_in("bfloat16"), report.count("float32")
      (True, 0)
    """
    jitted = (
        fun
        if hasattr(fun, "lower")
        else jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames)
    )

    def report(*args: Any, **kwargs: Any) -> PrecisionReport:
        return PrecisionReport.from_lowered(jitted.lower(*args, **kwargs), compiled=compiled)

    return report
