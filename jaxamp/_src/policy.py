"""Precision policies: which dtype params are stored in, compute runs in and outputs return in."""

from __future__ import annotations

import dataclasses
import difflib
import operator
from typing import Any, TypeAlias, TypeGuard, TypeVar

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp._src.dtypes import (
    FLOAT32,
    JMP_DTYPE_NAMES,
    canonical_dtype,
    is_float64,
    is_floating_array,
    is_narrow,
    is_narrower,
)
from jaxamp._src.errors import invalid_choice

T = TypeVar("T")


_GRAMMAR_KEYS = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "r": "reduce",
    "reduce": "reduce",
    "fp8": "fp8",
    "fp8_history": "fp8_history",
    "fp8_margin": "fp8_margin",
}

BLOCK_SCALINGS = ("mxfp8", "nvfp4")  # block-scaled formats (ops/block_scaling.py)
FP8_SCALINGS = ("current", "delayed", *BLOCK_SCALINGS)


# The largest margin: the amax, scaled to float8's largest value over 2**margin, still
# lands on a normal number of e4m3 (the forward GEMMs' format, smallest normal 2**-6):
# floor(log2(448 / 2**-6)) = 14. Beyond it the scaled operands flush toward zero
# (margin 16 turned a product of 1.5 into 1.10, margin 19 into 0, margin 128 into NaN).
MAX_MARGIN = 14


def recipe_integer(what: str, value: Any, least: int, most: int | None = None) -> int:
    """``value`` as an ``int``, refused unless it is an integer (a Python, NumPy or JAX
    integer scalar, not a bool) from ``least`` to ``most``: the one check of a float8
    recipe's integers, ``Fp8Recipe``'s and ``fp8_dot_general``'s ``margin`` (powers of
    two, from 0 to ``MAX_MARGIN``: a negative margin clips every operand above
    ``2**margin`` of its amax) and an ``amax_history_length`` (``>= 1``).

    Raises:
      ValueError: naming ``what``, the value given and the valid range.

    Examples:
      >>> recipe_integer("margin", -1, 0, MAX_MARGIN)
      Traceback (most recent call last):
      ...
      ValueError: margin must be an integer from 0 to 14, got -1.
    """
    valid = f"an integer >= {least}" if most is None else f"an integer from {least} to {most}"
    error = ValueError(f"{what} must be {valid}, got {value!r}.")
    if isinstance(value, (bool, np.bool_)):
        raise error
    try:
        integer = operator.index(value)
    except TypeError:
        raise error from None
    if integer < least or (most is not None and integer > most):
        raise error
    return int(integer)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a policy's matmuls run in float8 or float4 (guides/fp8.md, guides/block-scaling.md).

    Per-tensor scaling (``"current"``, ``"delayed"``) casts operands to ``float8_e4m3fn``
    and output gradients to ``float8_e5m2``, each divided by a per-tensor scale; block
    scaling (``"mxfp8"``, ``"nvfp4"``) gives each block of 32 or 16 values its own scale.
    Products are summed in float32.

    Attributes:
      scaling: ``"current"`` scales each tensor by its own amax, with no state;
        ``"delayed"`` by the largest amax of the last ``amax_history_length`` steps,
        kept as state beside the layer (as Flax's ``fp8_ops`` does); ``"mxfp8"``: e4m3
        values, a power-of-two scale per 32; ``"nvfp4"``: e2m1 values, an e4m3 scale per
        16 and a float32 scale per tensor.
      amax_history_length: steps of history delayed scaling keeps.
      margin: powers of two of headroom below the float8 maximum.

    Examples:
      >>> Fp8Recipe("delayed", amax_history_length=16).scaling
      'delayed'
    """

    scaling: str = "current"
    amax_history_length: int = 1024
    margin: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.scaling, str):  # as the grammar reads it: "Delayed" is "delayed"
            object.__setattr__(self, "scaling", self.scaling.strip().lower())
        if self.scaling not in FP8_SCALINGS:
            raise invalid_choice("fp8 scaling", self.scaling, FP8_SCALINGS)
        history = recipe_integer("Fp8Recipe.amax_history_length", self.amax_history_length, 1)
        object.__setattr__(self, "amax_history_length", history)
        margin = recipe_integer("Fp8Recipe.margin", self.margin, 0, MAX_MARGIN)
        object.__setattr__(self, "margin", margin)
        if self.block is not None and margin:
            raise ValueError(
                f"Fp8Recipe.margin is headroom for per-tensor scaling; {self.scaling!r} "
                f"scales each block to fit exactly and takes none, got margin={margin}."
            )

    @property
    def block(self) -> str | None:
        """The block-scaled format (``"mxfp8"``, ``"nvfp4"``), or ``None`` for per-tensor
        scaling."""
        return self.scaling if self.scaling in BLOCK_SCALINGS else None

    def spec(self) -> str:
        """The recipe in the policy grammar (``fp8=delayed,fp8_history=16``)."""
        spec = f"fp8={self.scaling}"
        if self.amax_history_length != Fp8Recipe.amax_history_length:
            spec += f",fp8_history={self.amax_history_length}"
        if self.margin != Fp8Recipe.margin:
            spec += f",fp8_margin={self.margin}"
        return spec


def _as_recipe(value: Any) -> Fp8Recipe | None:
    if value is None or isinstance(value, Fp8Recipe):
        return value
    if isinstance(value, str):
        return Fp8Recipe(value.strip().lower())
    raise TypeError(
        f"Policy.fp8 must be None, one of {', '.join(map(repr, FP8_SCALINGS))} or an "
        f"Fp8Recipe, got {value!r}."
    )


def cast_floating(tree: T, dtype: Any) -> T:
    """Casts the floating-point array leaves of ``tree`` to ``dtype``.

    Every floating leaf is cast, float64 under ``jax_enable_x64`` included: this is
    the explicit cast (``Policy.cast_to_compute`` and the policy's other casts leave a
    float64 leaf as written). Integer, boolean and PRNG-key leaves, and leaves that are
    not arrays (Python numbers, strings, ``None``), pass through untouched; leaves
    already in ``dtype`` are returned as they are, so no convert is emitted for them.

    Args:
      tree: any pytree.
      dtype: the target floating dtype.

    Returns:
      A pytree of the same structure.

    Raises:
      ValueError: if ``dtype`` is not a floating dtype (an integer one would truncate
        the values); names from jmp's grammar (``"bf16"``) are accepted.

    Examples:
      >>> import jax.numpy as jnp
      >>> tree = {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}
      >>> out = cast_floating(tree, jnp.bfloat16)
      >>> out["w"].dtype, out["step"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    return _cast(tree, canonical_dtype(dtype), keep_float64=False)


def _cast(tree: T, dtype: np.dtype, keep_float64: bool) -> T:
    """``cast_floating``; with ``keep_float64``, float64 leaves under ``jax_enable_x64``
    are left as they are (a policy's casts)."""

    def cast(x: Any) -> Any:
        if not is_floating_array(x) or x.dtype == dtype:
            return x
        return x if keep_float64 and is_float64(x.dtype) else x.astype(dtype)

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computation runs in, and outputs return in.

    A policy is frozen and hashable, so it can be a ``jax.jit`` static argument.
    Dtypes may be given as dtypes or as names (``"bf16"``, ``"float32"``).

    Attributes:
      param_dtype: dtype parameters are created and stored in (master weights).
      compute_dtype: dtype matmuls and convolutions take their operands in.
      output_dtype: dtype a model's outputs are returned in.
      reduce_dtype: dtype gradients are all-reduced in across devices. ``None``
        (the default) means float32 when ``compute_dtype`` is a 16-bit type and
        ``param_dtype`` otherwise; read it through ``grad_reduce_dtype``.
      fp8: ``None``, or an ``Fp8Recipe`` (or its scaling, ``"current"`` or
        ``"delayed"``): matmuls then take float8 operands and return
        ``compute_dtype``, which everything else runs in.

    Examples:
      >>> import jax.numpy as jnp
      >>> policy = Policy("float32", "bfloat16", "float32")
      >>> str(policy)
      'params=float32,compute=bfloat16,output=float32'
      >>> policy.cast_to_compute({"x": jnp.ones(2), "ids": jnp.arange(2)})["x"].dtype
      dtype(bfloat16)
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    reduce_dtype: Any = None
    fp8: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8", _as_recipe(self.fp8))
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, canonical_dtype(getattr(self, field), field))
        if self.reduce_dtype is not None:
            object.__setattr__(
                self, "reduce_dtype", canonical_dtype(self.reduce_dtype, "reduce_dtype")
            )

    @property
    def is_mixed(self) -> bool:
        """True when compute runs in a narrower floating type than params are stored in, or
        matmuls run in float8."""
        return self.fp8 is not None or is_narrower(self.compute_dtype, self.param_dtype)

    @property
    def grad_reduce_dtype(self) -> np.dtype:
        """The dtype gradients are reduced in across devices (see ``reduce_dtype``)."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        if is_narrow(self.compute_dtype) or self.fp8 is not None:
            return self.param_dtype if is_narrower(FLOAT32, self.param_dtype) else FLOAT32
        return self.param_dtype

    def cast_to_param(self, tree: T) -> T:
        """Casts floating leaves of ``tree`` to ``param_dtype``.

        Under ``jax_enable_x64`` a float64 leaf is left as it is, by this and the other
        ``cast_to_*`` methods: a policy leaves float64 as written, as ``torch.autocast``
        does (``jaxamp.cast_floating`` casts it). Without x64 JAX reads a float64 NumPy
        array as float32, and these cast it as jmp's do.
        """
        return _cast(tree, self.param_dtype, keep_float64=True)

    def cast_to_compute(self, tree: T) -> T:
        """Casts floating leaves of ``tree`` to ``compute_dtype`` (float64 under x64 kept)."""
        return _cast(tree, self.compute_dtype, keep_float64=True)

    def cast_to_output(self, tree: T) -> T:
        """Casts floating leaves of ``tree`` to ``output_dtype`` (float64 under x64 kept)."""
        return _cast(tree, self.output_dtype, keep_float64=True)

    def cast_to_reduce(self, tree: T) -> T:
        """Casts floating leaves of ``tree`` to ``grad_reduce_dtype`` (float64 under x64
        kept)."""
        return _cast(tree, self.grad_reduce_dtype, keep_float64=True)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """Returns a copy of this policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        spec = (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )
        if self.reduce_dtype is not None:
            spec += f",reduce={self.reduce_dtype.name}"
        if self.fp8 is not None:
            spec += f",{self.fp8.spec()}"
        return spec


PolicyLike: TypeAlias = Policy | jmp.Policy | str
"""What every ``policy`` argument takes: a ``Policy``, a ``jmp.Policy`` or a string naming
one for ``get_policy`` (a preset, a dtype name or the ``p=,c=,o=`` grammar).

Examples:
  >>> def compute_dtype(policy: PolicyLike) -> str:
  ...     return get_policy(policy).compute_dtype.name
  >>> compute_dtype("mixed_bfloat16"), compute_dtype(Policy(compute_dtype="float16"))
  ('bfloat16', 'float16')
"""


PRESETS: dict[str, Policy] = {
    "float32": Policy("float32", "float32", "float32"),
    "mixed_bfloat16": Policy("float32", "bfloat16", "float32"),
    "mixed_float16": Policy("float32", "float16", "float32"),
    "bfloat16": Policy("bfloat16", "bfloat16", "bfloat16"),
    "float16": Policy("float16", "float16", "float16"),
    "mixed_float8": Policy("float32", "bfloat16", "float32", fp8="current"),
    "mixed_float8_delayed": Policy("float32", "bfloat16", "float32", fp8="delayed"),
    "mixed_mxfp8": Policy("float32", "bfloat16", "float32", fp8="mxfp8"),
    "mixed_nvfp4": Policy("float32", "bfloat16", "float32", fp8="nvfp4"),
}
"""The named policies ``get_policy`` accepts (with the ``p=,c=,o=`` grammar and jmp's)."""


def _valid_choices() -> tuple[str, ...]:
    return (
        f"presets {', '.join(PRESETS)}; dtype names {', '.join(list(JMP_DTYPE_NAMES))}; "
        "or 'params=<dtype>,compute=<dtype>,output=<dtype>' (short keys p, c, o; "
        "optional reduce=<dtype> or r=<dtype>, fp8=current, fp8=delayed (with "
        "fp8_history=<steps>), fp8=mxfp8 or fp8=nvfp4, and fp8_margin=<powers of two> for "
        "the per-tensor two)",
    )


def _unknown(spec: str, bad: str, why: str) -> ValueError:
    candidates = list(PRESETS) + list(JMP_DTYPE_NAMES)
    close = difflib.get_close_matches(bad, candidates, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return invalid_choice(
        "policy", spec, _valid_choices(), why=f"Invalid policy {spec!r}: {why}.{hint}"
    )


def _parse_grammar(spec: str) -> Policy:
    """Parses jmp's ``key=value`` grammar, validating every part first."""
    values: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep and (part.strip() in PRESETS or part.strip() in JMP_DTYPE_NAMES):
            raise ValueError(
                f"Invalid policy {spec!r}: {part.strip()!r} names a whole policy and cannot "
                f"be combined with key=value parts; write it out, "
                f"{str(get_policy(part.strip()))!r}, and change or add keys there."
            )
        if not sep or not key or not value or "=" in value:
            raise _unknown(spec, part, f"part {part.strip()!r} is not of the form key=dtype")
        if key not in _GRAMMAR_KEYS:
            why = f"Invalid policy {spec!r}: unknown key {key!r}."
            raise invalid_choice("policy key", key, _GRAMMAR_KEYS, why=why)
        name = _GRAMMAR_KEYS[key]
        if name in values:
            raise ValueError(f"Invalid policy {spec!r}: {name!r} is given twice.")
        if name == "fp8":
            if value not in FP8_SCALINGS:
                why = f"Invalid policy {spec!r}: unknown fp8 scaling {value!r}."
                raise invalid_choice("fp8 scaling", value, FP8_SCALINGS, why=why)
        elif name in ("fp8_history", "fp8_margin"):
            least = 1 if name == "fp8_history" else 0
            if not value.lstrip("+-").isdigit() or int(value) < least:
                raise ValueError(
                    f"Invalid policy {spec!r}: {name}={value!r} must be an integer >= {least}."
                )
        else:
            canonical_dtype(value, f"dtype for {name!r} in policy {spec!r}:")
        values[name] = value
    reduce = values.pop("reduce", None)
    fp8: Fp8Recipe | str | None = values.pop("fp8", None)
    history, margin = values.pop("fp8_history", None), values.pop("fp8_margin", None)
    if (history is not None or margin is not None) and fp8 is None:
        raise ValueError(f"Invalid policy {spec!r}: fp8_history and fp8_margin need fp8=.")
    if history is not None and fp8 != "delayed":
        raise ValueError(
            f"Invalid policy {spec!r}: fp8_history is the amax history of fp8=delayed; "
            f"fp8={fp8} scales by each {'tensor' if fp8 == 'current' else 'block'}'s own "
            "amax and keeps none."
        )
    if fp8 is not None:
        fp8 = Fp8Recipe(
            str(fp8),
            int(history) if history is not None else Fp8Recipe.amax_history_length,
            int(margin) if margin is not None else Fp8Recipe.margin,
        )
    values = values or {"params": "float32"}  # "r=bf16" alone: jmp's default params
    # jmp owns the grammar's defaults: compute follows params, output follows compute.
    parsed = jmp.get_policy(",".join(f"{k}={v}" for k, v in values.items()))
    return Policy(parsed.param_dtype, parsed.compute_dtype, parsed.output_dtype, reduce, fp8)


def is_policy_spec(value: Any) -> TypeGuard[PolicyLike]:
    """Whether ``get_policy`` takes ``value``: a ``Policy``, a ``jmp.Policy`` or a string.

    Examples:
      >>> is_policy_spec("mixed_bfloat16"), is_policy_spec(jmp.get_policy("c=bf16"))
      (True, True)
      >>> is_policy_spec(0)
      False
    """
    return isinstance(value, (Policy, jmp.Policy, str))


def get_policy(spec: PolicyLike) -> Policy:
    """Returns the ``Policy`` named by ``spec``.

    Args:
      spec: a ``Policy`` (returned as is), a ``jmp.Policy``, a preset name
        (``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"``, ``"bfloat16"``,
        ``"float16"``, ``"mixed_float8"``, ``"mixed_float8_delayed"``,
        ``"mixed_mxfp8"``, ``"mixed_nvfp4"``), a dtype
        name for all three dtypes (``"f32"``, ``"bf16"``, ``"full"``, ``"half"``), or
        jmp's grammar such as
        ``"params=float32,compute=bfloat16,output=float32"`` or ``"p=f32,c=bf16"``
        (compute defaults to params, output to compute). An extra key
        ``reduce``/``r`` sets ``Policy.reduce_dtype``, and ``fp8=current`` or
        ``fp8=delayed`` runs matmuls in float8 (``"mixed_float8"`` is
        ``"p=f32,c=bf16,o=f32,fp8=current"``), with ``fp8_history=`` and
        ``fp8_margin=`` for ``Fp8Recipe``'s other fields; ``fp8=mxfp8`` and
        ``fp8=nvfp4`` run them block-scaled (``"mixed_mxfp8"``, ``"mixed_nvfp4"``).

    Returns:
      The policy.

    Raises:
      ValueError: if ``spec`` is a string that names no policy; the message names
        the bad part and the valid choices.
      TypeError: if ``spec`` is neither a string nor a policy.

    Examples:
      >>> get_policy("mixed_bfloat16") == get_policy("p=f32,c=bf16,o=f32")
      True
      >>> str(get_policy("c=f16"))
      'params=float32,compute=float16,output=float16'
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, jmp.Policy):
        return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
    if not isinstance(spec, str):
        raise TypeError(
            f"A policy must be a string or a jaxamp.Policy, got {type(spec).__name__}: {spec!r}."
        )
    name = spec.strip().lower()
    if name in PRESETS:
        return PRESETS[name]
    if "=" in name:
        return _parse_grammar(name)
    if name in JMP_DTYPE_NAMES:
        dtype = canonical_dtype(name)
        return Policy(dtype, dtype, dtype)
    raise _unknown(spec, name, f"{spec!r} is neither a preset nor a dtype name")
