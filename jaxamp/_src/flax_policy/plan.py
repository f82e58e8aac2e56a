"""The rules that turn a policy into settings of Flax layers, shared by Linen and NNX."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import dtypes as linen_dtypes
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from jaxamp._src.dtypes import is_16bit, is_float64, is_floating, is_narrower
from jaxamp._src.flax_policy import flax_internals
from jaxamp._src.flax_policy.fp8 import LinenDelayed, NnxDelayed
from jaxamp._src.jaxprs import FLOAT32_SCOPE, NO_FP8_SCOPE
from jaxamp._src.ops import attention
from jaxamp._src.ops.fp8 import Fp8DotGeneral
from jaxamp._src.ops.matmul import ConvGeneralDilated, DotGeneral
from jaxamp._src.policy import Policy, get_policy

EMBED_LAYERS: tuple[type[nn.Embed], type[nnx.Embed]] = (nn.Embed, nnx.Embed)
# Flax's weight reparametrisations: they normalise the wrapped layer's kernel (an l2 norm,
# a power iteration) and hand it over in their ``dtype``. They keep float32 (the wrapped
# layer casts the kernel in its matmul rule): in 16 bits the normalisation would round,
# and Linen's ``init`` would store the 16-bit kernel in place of the float32 param.
WEIGHT_WRAPPERS: tuple[type, ...] = (
    nn.WeightNorm,
    nn.SpectralNorm,
    nnx.WeightNorm,
    nnx.SpectralNorm,
)
_FLAX_ATTENTION_FNS = (nn.dot_product_attention, nnx.dot_product_attention)
_AS_WRITTEN = contextvars.ContextVar("jaxamp_layers_as_written", default=False)


@contextlib.contextmanager
def layers_as_written() -> Any:
    """A context in which layers run without the policy's settings, as the model's author
    wrote them (``jaxamp._src.autocast.api.interpreted`` reads constants off that trace)."""
    token = _AS_WRITTEN.set(True)
    try:
        yield
    finally:
        _AS_WRITTEN.reset(token)


def running_as_written() -> bool:
    """Whether layers run as written (inside ``layers_as_written``)."""
    return _AS_WRITTEN.get()


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What to do to one layer for one call.

    Attributes:
      attributes: ``(name, value)`` pairs to set on the layer.
      cast_output_to: dtype to cast the floating outputs to, or ``None``.
      matmul: the rule for a method Flax gives no matmul hook
        (``Embed.attend``, ``linen.Einsum``), which jaxamp then runs itself
        (see ``run_unhooked``), or ``None``.
    """

    attributes: tuple[tuple[str, Any], ...] = ()
    cast_output_to: Any = None
    matmul: DotGeneral | Fp8DotGeneral | LinenDelayed | None = None

    def __bool__(self) -> bool:
        return bool(self.attributes) or self.cast_output_to is not None or self.matmul is not None


def _is_complex_setting(value: Any) -> bool:
    """Whether a ``dtype``-like attribute holds a complex dtype."""
    try:
        return value is not None and jnp.issubdtype(np.dtype(value), jnp.complexfloating)
    except TypeError:
        return False


def _is_float_setting(value: Any) -> bool:
    """Whether a ``dtype``-like attribute holds a floating dtype (or nothing yet)."""
    if value is None:
        return True
    try:
        return jnp.issubdtype(np.dtype(value), jnp.floating)
    except TypeError:
        return False


def _is_float64_setting(value: Any) -> bool:
    """Whether a ``dtype``-like attribute holds float64 (under ``jax_enable_x64``)."""
    try:
        return value is not None and is_float64(np.dtype(value))
    except TypeError:
        return False


def _own_params(module: Any) -> list[Any]:
    """The values of a layer's own params (not its children's), where it has any yet."""
    if isinstance(module, nnx.Module):
        variables = [v for v in vars(module).values() if isinstance(v, nnx.Param)]
        return [v.get_value() if hasattr(v, "get_value") else v.value for v in variables]
    scope = getattr(module, "scope", None)
    if scope is None:
        return []
    params = scope.variables().get("params", {})
    return [v for v in params.values() if hasattr(v, "dtype")]


def writes_float64(module: Any) -> bool:
    """Whether a layer is written in float64 under ``jax_enable_x64``: its ``dtype`` or
    ``param_dtype`` is float64, or a param of its own is. A policy leaves it as written."""
    settings = (getattr(module, a, None) for a in ("param_dtype", "dtype"))
    if any(_is_float64_setting(value) for value in settings):
        return True
    return any(is_float64(p.dtype) for p in _own_params(module))


def has_float64(tree: Any) -> bool:
    """Whether a floating array leaf of ``tree`` is float64 under ``jax_enable_x64``: a
    layer called with one computes in float64 in Flax (its inputs promote its params),
    and a policy leaves it as written."""
    return any(is_float64(getattr(x, "dtype", None)) for x in jax.tree.leaves(tree))


def plan_layer(module: Any, policy: Policy, method_name: str = "__call__") -> LayerPlan:
    """Returns the settings that run ``module.<method_name>`` under ``policy``.

    Args:
      module: a Linen or NNX module.
      policy: the policy that applies to it.
      method_name: the method being called (Linen interceptors know it; NNX
        settings are made once, for ``__call__``).

    Returns:
      A ``LayerPlan``; empty when the module has nothing to set, for a
      complex layer (a complex ``param_dtype`` or ``dtype``), which a real
      compute dtype would cast to real, and for a layer written in float64
      (``writes_float64``).
    """
    if any(_is_complex_setting(getattr(module, a, None)) for a in ("param_dtype", "dtype")):
        return LayerPlan()
    if writes_float64(module):  # a policy leaves float64 as written
        return LayerPlan()
    attrs: dict[str, Any] = {}
    cast_output_to: Any = None
    matmul: DotGeneral | Fp8DotGeneral | LinenDelayed | None = None
    if hasattr(module, "param_dtype") and _is_float_setting(module.param_dtype):
        attrs["param_dtype"] = policy.param_dtype
    if (
        hasattr(module, "dtype")
        and _is_float_setting(module.dtype)
        and not isinstance(module, WEIGHT_WRAPPERS)
    ):
        attrs["dtype"] = policy.compute_dtype
    sixteen_bit = is_16bit(policy.compute_dtype)
    if sixteen_bit and getattr(module, "force_float32_reductions", True) is False:
        # Flax's flag to reduce in ``dtype``: a policy keeps every norm's statistics in
        # float32 (with it off, Linen's fast variance mixed a 16-bit mean(x**2) with a
        # float32 mean(x)**2, off by up to 1/sqrt(epsilon) where |mean| >> std)
        attrs["force_float32_reductions"] = True
    if (
        sixteen_bit
        and isinstance(module, NNX_NORMS)
        and getattr(module, "promote_dtype", None) is nnx_dtypes.promote_dtype
    ):
        attrs["promote_dtype"] = nnx_promote_keeping_wide
    # Under a float8 policy the matmuls no hook reaches (attention's two, Embed.attend) run
    # in the compute dtype, even float32: as the model wrote them, they would run in float8.
    narrow = sixteen_bit or policy.fp8 is not None
    if isinstance(module, EMBED_LAYERS):
        if method_name == "attend":  # a matmul against the table, with no hook
            matmul = DotGeneral(policy.compute_dtype) if narrow else None
        else:  # gather in the table's dtype, then cast the rows: the table's gradient is
            # scatter-added in float32, not in 16 bits
            attrs.pop("dtype", None)
            cast_output_to = policy.compute_dtype
    elif isinstance(module, nn.Einsum) and policy.fp8 is not None and method_name == "__call__":
        matmul = _fp8_rule(module, policy)
    elif isinstance(module, nn.Einsum) and sixteen_bit and method_name == "__call__":
        matmul = DotGeneral(policy.compute_dtype)
    elif policy.fp8 is not None:
        attrs.update(_matmul_hooks(module, policy.compute_dtype, _fp8_rule(module, policy)))
    elif sixteen_bit:
        attrs.update(_matmul_hooks(module, policy.compute_dtype))
    if narrow and getattr(module, "attention_fn", None) in _FLAX_ATTENTION_FNS:
        attrs["attention_fn"] = attention.dot_product_attention  # Flax's own otherwise
    changed = tuple((k, v) for k, v in attrs.items() if getattr(module, k) is not v)
    return LayerPlan(changed, cast_output_to, matmul)


# A layer's matmul hook, the functions Flax puts there by default, and the rule's factory.
_HOOKS = (
    ("dot_general", (None, lax.dot_general), DotGeneral),
    ("conv_general_dilated", (None, lax.conv_general_dilated), ConvGeneralDilated),
    ("einsum_op", (jnp.einsum,), lambda dtype: DotGeneral(dtype).einsum),
)


def _fp8_rule(module: Any, policy: Policy) -> Fp8DotGeneral | LinenDelayed:
    """The float8 matmul of ``module``: with the layer's state (delayed scaling) or without."""
    recipe = policy.fp8
    assert recipe is not None
    if recipe.scaling == "delayed" and isinstance(module, nn.Module):
        return LinenDelayed(module, policy.compute_dtype, recipe)
    if recipe.scaling == "delayed":  # NNX: the state of the layer being called
        return NnxDelayed(
            policy.compute_dtype, recipe.margin, None, history_length=recipe.amax_history_length
        )
    shape = getattr(module, "shape", None) if isinstance(module, nn.Einsum) else None
    if isinstance(module, nnx.Einsum):
        shape = module.kernel_shape
    kernel = tuple(shape) if recipe.block is not None and shape is not None else None
    return Fp8DotGeneral(
        policy.compute_dtype, recipe.margin, block=recipe.block, kernel_shape=kernel
    )


def _matmul_hooks(module: Any, compute_dtype: Any, fp8: Any = None) -> dict[str, Any]:
    """The rule in the layer's matmul hook, and a ``promote_dtype`` that leaves it the kernel.

    ``fp8`` is the float8 rule for ``dot_general`` and ``einsum_op`` hooks; convolutions
    keep the 16-bit rule (or none, for a float32 ``compute_dtype``).
    """
    if (
        getattr(module, "dot_general_cls", None) is not None
        or getattr(module, "conv_general_dilated_cls", None) is not None
    ):
        return {}  # a user's own matmul class (quantisation, say): leave it alone
    for name, defaults, rule in _HOOKS:
        if hasattr(module, name) and any(getattr(module, name) is d for d in defaults):
            if fp8 is not None and name == "dot_general":
                hook = fp8
            elif fp8 is not None and name == "einsum_op":
                hook = fp8.einsum
            elif is_16bit(compute_dtype):
                hook = rule(compute_dtype)
            else:
                return {}
            hooks = {name: hook}
            promote = getattr(module, "promote_dtype", None)
            if promote is linen_dtypes.promote_dtype:
                hooks["promote_dtype"] = promote_keeping_kernel
            elif promote is nnx_dtypes.promote_dtype:
                hooks["promote_dtype"] = nnx_promote_keeping_kernel
            return hooks
    return {}


def has_complex(tree: Any) -> bool:
    """Whether any array leaf of ``tree`` is complex (a real compute dtype would drop its
    imaginary part)."""
    return any(
        jnp.issubdtype(getattr(x, "dtype", np.float32), jnp.complexfloating)
        for x in jax.tree.leaves(tree)
    )


def promote_keeping_kernel(*args: Any, dtype: Any = None, inexact: bool = True) -> list[Any]:
    """Flax Linen's ``promote_dtype``, but the kernel (second argument) keeps its dtype.

    The matmul rule casts the kernel itself, so that the backward pass keeps no
    16-bit copy of it and its gradient leaves the GEMM in float32. Complex
    inputs promote as Flax would without a compute dtype (they stay complex).
    """
    if has_complex(args):
        return list(linen_dtypes.promote_dtype(*args, dtype=None, inexact=inexact))
    out = list(linen_dtypes.promote_dtype(*args, dtype=dtype, inexact=inexact))
    if len(args) > 1 and args[1] is not None:
        out[1] = args[1]
    return out


# NNX's norms promote their input to the layer's dtype before their statistics; Linen's
# read it as given.
NNX_NORMS = (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.InstanceNorm)


def nnx_promote_keeping_wide(args: Any, /, *, dtype: Any = None, inexact: bool = True) -> Any:
    """Flax NNX's ``promote_dtype`` for a norm under a 16-bit policy: its arrays promoted
    among themselves, not to the layer's 16-bit ``dtype``, so that its statistics read a
    float32 input (a residual stream kept in float32) as given, as a Linen norm does. The
    norm still casts its output to ``dtype``."""
    return nnx_dtypes.promote_dtype(args, dtype=None, inexact=inexact)


def nnx_promote_keeping_kernel(args: Any, /, *, dtype: Any = None, inexact: bool = True) -> Any:
    """``promote_keeping_kernel`` with Flax NNX's signature."""
    if has_complex(args):
        return nnx_dtypes.promote_dtype(args, dtype=None, inexact=inexact)
    out = nnx_dtypes.promote_dtype(args, dtype=dtype, inexact=inexact)
    if len(args) > 1 and args[1] is not None:
        out = type(out)((out[0], args[1], *out[2:]))
    return out


def run_unhooked(module: Any, plan: LayerPlan, *args: Any, **kwargs: Any) -> Any:
    """Runs a method Flax gives no matmul hook (``Embed.attend``, ``linen.Einsum``).

    Args:
      module: the (bound) layer.
      plan: its plan, whose ``matmul`` is set.
      *args: the method's arguments.
      **kwargs: its keyword arguments.

    Returns:
      What the method returns, with its matmul under the rule.
    """
    rule = plan.matmul
    assert rule is not None  # the interceptor calls this only for a plan with a matmul
    if isinstance(module, EMBED_LAYERS):
        (query,) = args
        table = module.embedding
        table = table[...] if isinstance(table, nnx.Variable) else table
        dn = (((query.ndim - 1,), (1,)), ((), ()))
        if not is_16bit(rule.compute_dtype):  # float32 under a float8 policy: as written
            with jax.named_scope(FLOAT32_SCOPE):
                return lax.dot_general(query.astype(rule.compute_dtype), table, dn)
        return rule(query.astype(rule.compute_dtype), table, dn)
    return _linen_einsum(module, rule, *args, **kwargs)


def _linen_einsum(
    module: nn.Einsum, rule: Any, inputs: Any, einsum_str: str | None = None
) -> jax.Array:
    """``flax.linen.Einsum.__call__`` with its contraction under the rule."""
    einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    y = rule.einsum(
        einsum_str, inputs.astype(rule.compute_dtype), kernel, precision=module.precision
    )
    if module.use_bias:
        bias_shape, broadcast_shape = flax_internals.einsum_bias_shape(
            module, einsum_str, inputs, kernel
        )
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
        y += jnp.reshape(bias.astype(rule.compute_dtype), broadcast_shape)
    return y


def runs_as_traced(root: Policy, policy: Policy) -> bool:
    """Whether a layer under ``policy`` is evaluated exactly as traced inside a model under
    ``root``: its policy computes wider than the root's (an override to float32), or in
    float32 as the root does but without the root's float8 (``"float32"`` under
    ``p=f32,c=f32,fp8=...``), so that no rule of the root reaches its matmuls."""
    if is_narrower(root.compute_dtype, policy.compute_dtype):
        return True
    return (
        root.fp8 is not None
        and policy.fp8 is None
        and not is_16bit(policy.compute_dtype)
        and np.dtype(policy.compute_dtype) == np.dtype(root.compute_dtype)
    )


def leaves_float8(root: Policy, policy: Policy) -> bool:
    """Whether an override takes a layer out of the root's float8 into a 16-bit policy."""
    return root.fp8 is not None and policy.fp8 is None and not runs_as_traced(root, policy)


def layer_scope(root: Policy, policy: Policy) -> Any:
    """A context for a layer's calls inside a model under ``root``: one that
    ``runs_as_traced`` in ``FLOAT32_SCOPE``, which the autocast interpreter evaluates
    exactly as traced (matmuls the layer writes itself stay in float32); one an override
    takes out of float8 into 16 bits in ``NO_FP8_SCOPE``, where its own matmuls run
    under the 16-bit rule. A child inside either keeps its parent's scope for the matmuls
    it writes itself; Flax's layers in it take their own policy through their hooks."""
    if runs_as_traced(root, policy):
        return jax.named_scope(FLOAT32_SCOPE)
    if leaves_float8(root, policy):
        return jax.named_scope(NO_FP8_SCOPE)
    return contextlib.nullcontext()


def normalize_overrides(
    overrides: Mapping[Any, Any] | Iterable[tuple[Any, Any]] | None,
) -> tuple[tuple[Any, Policy], ...]:
    """Validates ``overrides`` and parses their policies.

    Args:
      overrides: a mapping (or pairs) from a key to a policy spec. A key is a
        module class (the policy applies to its instances and everything inside
        them) or a glob pattern matched against a module's path, such as
        ``"head"``, ``"Dense_*"`` or ``"encoder/*/attention"`` (a pattern also
        matches at the end of a path, and applies to the subtree below a match).

    Returns:
      A tuple of ``(key, Policy)`` pairs, in the given order.

    Raises:
      TypeError: for a key that is neither a string nor a class.
      ValueError: for a value that names no policy.
    """
    if overrides is None:
        return ()
    items = list(overrides.items() if isinstance(overrides, Mapping) else overrides)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                "overrides must map a module class or a path pattern to a policy, e.g. "
                f"{{'head': 'float32'}} or [('head', 'float32')]; got {overrides!r}, whose "
                f"item {item!r} is not a (key, policy) pair."
            )
    result = []
    for key, spec in items:
        if not isinstance(key, (str, type)):
            raise TypeError(
                f"An override key must be a module class or a path pattern (str), got {key!r}."
            )
        result.append((key, get_policy(spec)))
    return tuple(result)


def _path_matches(path: tuple[Any, ...], pattern: str) -> bool:
    text = "/".join(str(p) for p in path)
    return fnmatch.fnmatchcase(text, pattern) or fnmatch.fnmatchcase(text, "*/" + pattern)


def resolve_policy(
    default: Policy,
    overrides: tuple[tuple[Any, Policy], ...],
    chain: Iterable[tuple[tuple[Any, ...], Any]],
) -> Policy:
    """The policy for a module, from the innermost matching override outwards.

    Args:
      default: the policy when no override matches.
      overrides: as returned by ``normalize_overrides``.
      chain: ``(path, module)`` pairs from the module itself up to the root.

    Returns:
      The policy of the closest override that matches, else ``default``.
    """
    if not overrides:
        return default
    for path, module in chain:
        for key, policy in overrides:
            if _key_matches(key, path, module):
                return policy
    return default


def _key_matches(key: Any, path: tuple[Any, ...], module: Any) -> bool:
    """Whether an override key (a class, or a path pattern) names this module."""
    if isinstance(key, type):
        return isinstance(module, key)
    return bool(path) and _path_matches(tuple(path), key)


def warn_unmatched(
    overrides: tuple[tuple[Any, Policy], ...],
    chains: Iterable[Iterable[tuple[tuple[Any, ...], Any]]],
    model: str,
) -> None:
    """Warns about each override key that matches no module of ``chains`` (each a layer's
    ``(path, module)`` pairs up to the root, as ``resolve_policy`` takes them), naming a
    few of the layer paths it could have matched."""
    pairs = {(tuple(path), id(module)): (path, module) for c in chains for path, module in c}
    matched = {key for key, _ in overrides for p, m in pairs.values() if _key_matches(key, p, m)}
    paths = [path for path, _ in pairs.values()]
    unmatched = [key for key, _ in overrides if key not in matched]
    if not unmatched:
        return
    names = sorted({"/".join(map(str, path)) for path in paths if path})
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    for key in unmatched:
        what = key.__name__ if isinstance(key, type) else repr(key)
        warnings.warn(
            f"The override {what} matched no layer of {model}, so it changes nothing. "
            f"A string key is a glob pattern matched at the end of a layer's path; "
            f"this model's layers include: {shown or 'none'}.",
            stacklevel=_caller_stacklevel(),
        )


def carry_as_given(
    module: Any, method_name: str, args: tuple[Any, ...], out: Any, loop_body: bool = False
) -> Any:
    """A recurrent cell's ``(carry, y)`` with the new carry in the dtypes of the one it was
    given: a cell running in 16 bits would otherwise turn the float32 carry of
    ``initialize_carry`` into a 16-bit one, and the loop around it refuse the change."""
    is_cell = loop_body or isinstance(module, (nn.RNNCellBase, nnx.RNNCellBase))
    # ``nn.RNN`` calls the cell through ``nn.scan`` as a method named ``scan_fn``.
    if not is_cell or method_name == "initialize_carry" or not args:
        return out
    if not isinstance(out, tuple) or len(out) != 2:
        return out
    carry, y = out
    given = args[0] if args else None
    # jaxlib ships PyTreeDef in a compiled module without a stub: mypy sees no __ne__
    if jax.tree.structure(carry) != jax.tree.structure(given):  # type: ignore[operator]
        return out

    def as_given(new: Any, old: Any) -> Any:
        new_dtype, old_dtype = getattr(new, "dtype", None), getattr(old, "dtype", None)
        if is_floating(new_dtype) and is_floating(old_dtype) and new_dtype != old_dtype:
            return new.astype(old_dtype)
        return new

    return jax.tree.map(as_given, carry, given), y


_CARRY_HINT = "jaxamp: the layers under this policy"


@contextlib.contextmanager
def explaining_carry_errors(policy: Policy) -> Any:
    """Adds to JAX's loop-carry ``TypeError`` what under a policy causes it and its fixes."""
    try:
        yield
    except TypeError as error:
        message = str(error)
        if "carry" not in message or "dtypes do not match" not in message:
            raise
        if _CARRY_HINT in message:
            raise
        compute = np.dtype(policy.compute_dtype).name
        raise TypeError(
            f"{message}\n\n{_CARRY_HINT} run in their own compute dtype ({compute} here, or "
            "an override's where one matches), as the same layers with that `dtype` in Flax "
            "would, so a loop carry (lax.scan, nn.scan, nnx.scan, fori_loop) whose first "
            "value has another dtype changes dtype in the loop. If the carry starts in "
            "float32 (jnp.zeros(shape) is float32) and a 16-bit layer computes it, start it "
            "in the dtype of what computes it (jnp.zeros(shape, x.dtype)). If an override "
            "gives the looped layer a wider dtype than the carry's first value (the model's "
            "inputs come in its compute dtype), put the override on the layers inside the "
            "looped one, or on the layers that compute the first value too."
        ) from error


_LIBRARIES = (
    f"{os.sep}jaxamp{os.sep}_src{os.sep}",
    f"{os.sep}flax{os.sep}",
    f"{os.sep}jax{os.sep}",
)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jaxamp, Flax and JAX (the user's call)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (
        any(part in frame.f_code.co_filename for part in _LIBRARIES)
        or frame.f_code.co_filename.startswith("<frozen")
        or frame.f_code.co_filename.endswith(("contextlib.py", "functools.py"))
    ):
        frame, level = frame.f_back, level + 1
    return level


def in_layer_dtype(value: Any, dtype: Any) -> Any:
    """``value`` (a decode cache) in its layer's floating ``dtype``; itself if it already
    is, or if either is not floating (the caller writes back only a new value)."""
    current = getattr(value, "dtype", None)
    if dtype is None or not (is_floating(current) and is_floating(dtype)):
        return value
    return value if np.dtype(current) == np.dtype(dtype) else value.astype(dtype)
