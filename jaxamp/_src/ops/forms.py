"""The forms a 16-bit GEMM takes on each backend, how one is chosen, and how to override it."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.errors import invalid_choice

ENV_VAR = "JAXAMP_MATMUL_FORM"


@dataclasses.dataclass(frozen=True)
class MatmulForm:
    """How the 16-bit GEMMs are given to the compiler (see the table in this module).

    Attributes:
      name: ``"native"``, ``"canonical"`` or ``"upcast"``.
      canonical_layout: materialise operand and result transposes, so that each
        GEMM sees ``[batch, free, contracting]`` operands.
      upcast: convert the 16-bit operands to float32 and run a float32 GEMM.
    """

    name: str
    canonical_layout: bool = False
    upcast: bool = False


FORMS: dict[str, MatmulForm] = {
    "native": MatmulForm("native"),
    "canonical": MatmulForm("canonical", canonical_layout=True),
    "upcast": MatmulForm("upcast", upcast=True),
}
"""The matmul forms by name (``JAXAMP_MATMUL_FORM`` and ``use_matmul_form`` take these)."""

_OVERRIDE: contextvars.ContextVar[MatmulForm | None] = contextvars.ContextVar(
    "jaxamp_matmul_form", default=None
)


def get_form(form: str | MatmulForm) -> MatmulForm:
    """The ``MatmulForm`` named ``form`` (a form is returned as it is).

    Raises:
      ValueError: if ``form`` names no form; the message lists the valid names.
    """
    if isinstance(form, MatmulForm):
        return form
    if isinstance(form, str) and form.strip().lower() in FORMS:
        return FORMS[form.strip().lower()]
    raise invalid_choice("matmul form", form, FORMS)


@contextlib.contextmanager
def use_matmul_form(form: str | MatmulForm) -> Iterator[MatmulForm]:
    """Runs the 16-bit matmul rule in ``form`` for everything traced inside the block.

    Overrides the backend's choice (and ``JAXAMP_MATMUL_FORM``). Functions that
    ``jax.jit`` traced before the block keep the form they were traced with.

    Args:
      form: ``"native"``, ``"canonical"`` or ``"upcast"`` (see this module's table).

    Yields:
      The form.

    Raises:
      ValueError: if ``form`` names no form.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> f = jaxamp.autocast(lambda w, x: x @ w)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> with jaxamp.ops.use_matmul_form("upcast"):
      ...     ops = jaxamp.precision_report(f)(w, x).ops
      >>> [(op.lhs_dtype, op.accumulation_dtype, op.upcast) for op in ops]
      [('bfloat16', 'float32', True)]
    """
    chosen = get_form(form)
    token = _OVERRIDE.set(chosen)
    try:
        yield chosen
    finally:
        _OVERRIDE.reset(token)


def override() -> MatmulForm | None:
    """The form ``use_matmul_form`` or ``JAXAMP_MATMUL_FORM`` asks for, or ``None``."""
    chosen = _OVERRIDE.get()
    if chosen is not None:
        return chosen
    name = os.environ.get(ENV_VAR, "").strip()
    if not name:
        return None
    try:
        return get_form(name)
    except ValueError as e:
        raise ValueError(f"{ENV_VAR}={name!r}: {e}") from e


def platform_form(platform: str | None, dtype: Any) -> MatmulForm:
    """The form a GEMM in ``dtype`` takes when lowered for ``platform``, with no override."""
    if platform == "cpu":
        return FORMS["canonical" if np.dtype(dtype) == jnp.bfloat16 else "upcast"]
    return FORMS["native"]


def matmul_form(platform: str | None = None, dtype: Any = jnp.bfloat16) -> MatmulForm:
    """The form of the 16-bit GEMMs in ``dtype`` on ``platform`` (default: the default backend).

    An override (``use_matmul_form``, ``JAXAMP_MATMUL_FORM``) wins; else
    ``canonical`` for bfloat16 and ``upcast`` for float16 on CPUs, ``native``
    elsewhere. Without an override the form is chosen when a program is lowered,
    for the platform it is lowered for (a program exported for GPUs from a CPU
    host, or run on the CPU of a GPU host, takes that platform's form). A
    ``native`` override on a CPU warns: XLA:CPU fails to run some of its
    bfloat16 dots.

    Examples:
      >>> matmul_form("gpu").name, matmul_form("cpu").name, matmul_form("cpu", "float16").name
      ('native', 'canonical', 'upcast')
    """
    platform = jax.default_backend() if platform is None else platform
    chosen = override()
    if chosen is not None:
        warn_if_unsafe(chosen, platform, dtype)
        return chosen
    return platform_form(platform, dtype)


def warn_if_unsafe(form: MatmulForm, platform: str | None, dtype: Any) -> None:
    """Warns when ``form`` is the ``native`` form of a bfloat16 GEMM on XLA:CPU, which
    fails to run some of them (a Hessian-vector product's, for one)."""
    if form.name == "native" and platform == "cpu" and np.dtype(dtype) == jnp.bfloat16:
        warnings.warn(
            "The 'native' matmul form on XLA:CPU: some bfloat16 dots it makes fail at run "
            "time (UNIMPLEMENTED: ... DotThunk::Execute: BF16 x BF16 = F32); 'canonical' "
            "runs them.",
            stacklevel=3,
        )


# --------------------------------------------------------------------------- the GEMMs


def free_dims(ndim: int, *used: Sequence[int]) -> list[int]:
    """The dimensions of an operand that are neither contracted nor batched."""
    taken = {int(d) for dims in used for d in dims}
    return [d for d in range(ndim) if d not in taken]


def materialize(x: jax.Array, perm: Sequence[int]) -> jax.Array:
    """``jnp.transpose(x, perm)`` that XLA cannot fold back into the consumer's layout.

    XLA folds a transpose into the dimension numbers of the dot that reads it;
    flattening the transposed value behind an optimisation barrier makes it a
    row-major array of its own.
    """
    if list(perm) == list(range(x.ndim)):
        return x
    y = jnp.transpose(x, perm)
    return lax.optimization_barrier(y.reshape(-1)).reshape(y.shape)


def _canonical_dot(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any) -> jax.Array:
    """``dot_general`` on operands laid out ``[batch, free, contracting]``, as matrices.

    Free and contracting dims are each collapsed into one, so XLA:CPU sees a
    (batched) matrix product: it has no 16-bit kernel for a dot with several
    contracting dims and fails on one ("Unsupported element type for DotThunk").
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lfree, rfree = free_dims(lhs.ndim, lc, lb), free_dims(rhs.ndim, rc, rb)
    batch_shape = tuple(lhs.shape[d] for d in lb)
    lfree_shape = tuple(lhs.shape[d] for d in lfree)
    rfree_shape = tuple(rhs.shape[d] for d in rfree)
    k = math.prod(lhs.shape[d] for d in lc)  # symbolic dimensions multiply too
    m = math.prod(lfree_shape)
    n = math.prod(rfree_shape)
    nb = len(lb)
    a = materialize(lhs, [*lb, *lfree, *lc]).reshape(*batch_shape, m, k)
    if not rb and list(rc) + rfree == list(range(rhs.ndim)):
        b = rhs.reshape(k, n)  # [contracting, free]: as fast as [free, contracting]
        b_contract = 0
    else:
        b = materialize(rhs, [*rb, *rfree, *rc]).reshape(*batch_shape, n, k)
        b_contract = nb + 1
    batch = tuple(range(nb))
    dn = (((nb + 1,), (b_contract,)), (batch, batch))
    out = lax.dot_general(a, b, dn, precision=precision, preferred_element_type=FLOAT32)
    # Behind a barrier too: XLA:CPU would fold a transpose of the result (``vmap`` adds
    # them) into a new dot after choosing the 16-bit kernels, and that dot fails to run.
    out = lax.optimization_barrier(out.reshape(-1))
    return out.reshape(*batch_shape, *lfree_shape, *rfree_shape)


def gemm(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any,
    form: MatmulForm,
    out_sharding: Any = None,
) -> jax.Array:
    """The one GEMM shape, in ``form``: 16-bit operands, float32 products and sums."""
    if form.upcast:
        lhs, rhs = lhs.astype(FLOAT32), rhs.astype(FLOAT32)
    if form.canonical_layout:
        return _canonical_dot(lhs, rhs, dimension_numbers, precision)
    return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=FLOAT32,
        out_sharding=out_sharding,
    )


def permute(x: jax.Array, axes: Sequence[int], form: MatmulForm) -> jax.Array:
    """Transposes a GEMM's result; materialised where XLA:CPU would fold it into the GEMM.

    XLA:CPU folds ``transpose(dot(a, b))`` into a new dot after it has chosen
    which dots run on 16-bit kernels, and the new one fails at run time
    ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    """
    axes = tuple(int(a) for a in axes)
    if axes == tuple(range(x.ndim)):
        return x
    if form.canonical_layout:
        return materialize(x, axes)
    return jnp.transpose(x, axes)


def sharded_in_type(*xs: Any) -> bool:
    """Whether any of ``xs`` carries a sharding in its type (``Explicit`` mesh axes)."""
    for x in xs:
        sharding = getattr(jax.typeof(x), "sharding", None)
        if any(p is not None for p in getattr(sharding, "spec", ())):
            return True
    return False
