"""The rule table of ``jaxamp.autocast``: which primitive runs in the compute dtype, in float32,
in the widest dtype that arrives, or as traced."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
from collections.abc import Iterable
from typing import Any

import jax.extend as jex
from jax import lax

from jaxamp._src.dtypes import is_narrow
from jaxamp._src.errors import invalid_choice
from jaxamp._src.policy import Policy


def primitive_names(*attributes: str) -> frozenset[str]:
    """Primitive names of ``jax.lax.<attribute>`` objects; those a JAX version lacks are skipped."""
    return frozenset(p.name for p in (getattr(lax, a, None) for a in attributes) if p is not None)


COMPUTE_PRIMITIVES = primitive_names("dot_general_p", "conv_general_dilated_p")

FLOAT32_PRIMITIVES = primitive_names(
    "exp_p",
    "exp2_p",
    "log_p",
    "log1p_p",
    "expm1_p",
    "pow_p",
    "integer_pow_p",
    "square_p",
    "rsqrt_p",
    "sqrt_p",
    "tan_p",
    "acos_p",
    "asin_p",
    "cosh_p",
    "sinh_p",
    "logistic_p",
    "erf_p",
    "erfc_p",
    "erf_inv_p",
    "lgamma_p",
    "digamma_p",
    "reduce_sum_p",
    "reduce_max_p",
    "reduce_min_p",
    "reduce_prod_p",
    "reduce_window_sum_p",
    "scatter_add_p",
    "cumsum_p",
    "cumprod_p",
    "cumlogsumexp_p",
    "psum_p",
) | {"psum_invariant"}  # ``lax.psum`` inside ``shard_map`` (jax >= 0.7)

PROMOTE_PRIMITIVES = primitive_names(
    # elementwise binary and ternary arithmetic, comparisons
    "add_p",
    "sub_p",
    "mul_p",
    "div_p",
    "rem_p",
    "max_p",
    "min_p",
    "atan2_p",
    "nextafter_p",
    "eq_p",
    "ne_p",
    "lt_p",
    "le_p",
    "gt_p",
    "ge_p",
    "select_n_p",
    "clamp_p",
    # elementwise unary
    "neg_p",
    "sign_p",
    "abs_p",
    "floor_p",
    "ceil_p",
    "round_p",
    "is_finite_p",
    "cbrt_p",
    "tanh_p",
    "sin_p",
    "cos_p",
    "atan_p",
    "stop_gradient_p",
    "reduce_precision_p",
    # shapes, indexing, order
    "broadcast_in_dim_p",
    "reshape_p",
    "transpose_p",
    "squeeze_p",
    "rev_p",
    "slice_p",
    "dynamic_slice_p",
    "dynamic_update_slice_p",
    "gather_p",
    "concatenate_p",
    "pad_p",
    "split_p",
    "copy_p",
    "sharding_constraint_p",
    "argmax_p",
    "argmin_p",
    "cummax_p",
    "cummin_p",
    "sort_p",
    "reduce_window_max_p",
    "reduce_window_min_p",
    "optimization_barrier_p",
) | {"add_any"}  # the sum of two cotangents, when ``fun`` takes gradients itself


def _known_primitive_names() -> frozenset[str]:
    """The names of the primitives the imported JAX, Flax and jaxamp modules define."""
    names = set()
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").partition(".")[0] not in _DEFINING_PACKAGES:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jex.core.Primitive):
                names.add(value.name)
    return frozenset(names)


_DEFINING_PACKAGES = frozenset({"jax", "jaxlib", "flax", "jaxamp"})
# JAX's modules that define primitives and that ``import jax`` does not import: imported
# when a name is not found among the imported ones (``pallas_call``, ``bcoo_dot_general``).
_MORE_PRIMITIVES = (
    "jax.experimental.sparse",
    "jax.experimental.pallas",
    "jax.experimental.custom_partitioning",
    "jax.experimental.jet",
    "jax.scipy.special",
    "jax.lax.linalg",
)


def _import_more_primitives() -> None:
    for name in _MORE_PRIMITIVES:
        try:
            importlib.import_module(name)
        except Exception:  # a module this JAX lacks, or one that fails to import here
            continue


def _check_known(name: str, field: str) -> None:
    """Refuses a primitive name no imported module defines (``"tanhh"``), listing close
    ones; a primitive of the caller's own is given as the object, which is taken as is."""
    known = _known_primitive_names()
    if name not in known:
        _import_more_primitives()
        known = _known_primitive_names()
    if name in known:
        return
    close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
    why = (
        f"AutocastRules.{field} names {name!r}, but no primitive of JAX, Flax or jaxamp has "
        "that name (for a primitive of your own, give the primitive object, not its name)."
    )
    if not close:
        raise ValueError(f"{why} No primitive has a close name.")
    raise invalid_choice("primitive", name, close, quote=True, why=why)


def _primitive_names(value: Iterable[Any], field: str) -> frozenset[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"AutocastRules.{field} must be a set of primitive names, got {type(value).__name__}: "
            f"{value!r}."
        )
    names = []
    for item in value:
        name = getattr(item, "name", item)
        if not isinstance(name, str):
            raise TypeError(
                f"AutocastRules.{field} holds {item!r}; expected primitive names such as "
                f"{lax.exp_p.name!r} or primitives such as jax.lax.exp_p."
            )
        if isinstance(item, str) and item not in _DEFAULT_NAMES:
            _check_known(item, field)
        names.append(name)
    return frozenset(names)


_DEFAULT_NAMES = COMPUTE_PRIMITIVES | FLOAT32_PRIMITIVES | PROMOTE_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """Which primitives ``jaxamp.autocast`` runs in the compute dtype, in float32, or as given.

    Frozen and hashable. Start from ``jaxamp.AUTOCAST_RULES`` and replace a
    field to change it; entries may be primitive names or primitives
    (``jax.lax.tanh_p``). A primitive in two sets follows the first of
    ``compute``, ``float32``, ``promote``; a primitive in none runs as traced.

    Attributes:
      compute: primitives whose floating operands are cast to the compute dtype
        (``dot_general``, ``conv_general_dilated``).
      float32: primitives whose floating inputs are cast up to float32.
      promote: primitives that run in the dtype their inputs arrive in.

    Raises:
      ValueError: for a name no primitive of JAX, Flax or jaxamp has (``"tanhh"``),
        listing the close ones.

    Examples:
      >>> import dataclasses, jax
      >>> import jaxamp
      >>> rules = dataclasses.replace(
      ...     jaxamp.AUTOCAST_RULES, float32=jaxamp.AUTOCAST_RULES.float32 | {jax.lax.tanh_p}
      ... )
      >>> rules.rule_for("tanh"), jaxamp.AUTOCAST_RULES.rule_for("tanh")
      ('float32', 'promote')
    """

    compute: frozenset[str] = COMPUTE_PRIMITIVES
    float32: frozenset[str] = FLOAT32_PRIMITIVES
    promote: frozenset[str] = PROMOTE_PRIMITIVES

    def __post_init__(self) -> None:
        for field in ("compute", "float32", "promote"):
            object.__setattr__(self, field, _primitive_names(getattr(self, field), field))

    def rule_for(self, name: str) -> str:
        """``"compute"``, ``"float32"``, ``"promote"`` or ``"traced"`` for a primitive name."""
        for field in ("compute", "float32", "promote"):
            if name in getattr(self, field):
                return field
        return "traced"


AUTOCAST_RULES = AutocastRules()
"""The default rules of ``jaxamp.autocast``; change them with ``dataclasses.replace``."""


def policy_rules(rules: AutocastRules | None = None) -> AutocastRules:
    """The rules ``apply_policy`` evaluates a model with: ``AUTOCAST_RULES`` for
    ``None``, else ``rules`` (validated). They are autocast's: a matmul the model writes
    itself runs in the compute dtype as under ``jaxamp.autocast``, sensitive
    primitives run in float32; layers a policy override keeps in float32 run as traced.

    Raises:
      TypeError: if ``rules`` is not an ``AutocastRules``.
    """
    rules = AUTOCAST_RULES if rules is None else rules
    if not isinstance(rules, AutocastRules):
        raise TypeError(
            f"rules must be a jaxamp.AutocastRules, got {type(rules).__name__}: {rules!r}; start "
            "from dataclasses.replace(jaxamp.AUTOCAST_RULES, ...)."
        )
    return rules


def narrows(policy: Policy) -> bool:
    """Whether ``policy`` narrows anything: params or compute in fewer than 32 bits, or
    GEMMs in float8. One that does not (``"float32"``) is the identity."""
    narrow = is_narrow(policy.param_dtype) or is_narrow(policy.compute_dtype)
    return narrow or policy.fp8 is not None


@dataclasses.dataclass(frozen=True)
class AutocastConfig:
    """What the autocast interpreter evaluates with: a policy and a rule table.

    Attributes:
      policy: the policy (the root policy, for ``apply_policy``).
      rules: the rule table.
      layer_policies: the other policies layers inside take (``apply_policy``'s overrides).
      float32_scopes: glob patterns of named scopes evaluated as traced, in float32
        (``autocast``'s overrides; see ``jaxprs.in_scopes``).
    """

    policy: Policy
    rules: AutocastRules
    layer_policies: tuple[Policy, ...] = ()
    float32_scopes: tuple[str, ...] = ()

    @property
    def as_traced(self) -> bool:
        """Whether no policy here narrows anything (``narrows``): the program is then
        evaluated as traced, with no rule, so a float32 policy is the identity even on
        code that rounds to 16 bits itself."""
        return not any(narrows(p) for p in (self.policy, *self.layer_policies))
