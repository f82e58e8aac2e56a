"""Op-level automatic mixed precision for any JAX function, like ``torch.autocast``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxamp._src.autocast import constants, first_order, fp8_state, graphs, higher_order
from jaxamp._src.autocast.context import CallContext
from jaxamp._src.autocast.graphs import GraphSplitter, Nodes
from jaxamp._src.autocast.interpreter import cast_to_traced, eval_jaxpr
from jaxamp._src.autocast.rules import AUTOCAST_RULES, AutocastConfig, AutocastRules, narrows
from jaxamp._src.autocast.weights import Weights
from jaxamp._src.dtypes import FLOAT32, is_16bit, is_narrow, is_narrower
from jaxamp._src.jaxprs import FLOAT32_SCOPE, eqns_in_scopes, scope_paths
from jaxamp._src.ops.residuals import checkpoint_residuals, partition_arrays, validate_residuals
from jaxamp._src.policy import PolicyLike, get_policy

# The rule modules fill the interpreter's tables as they are imported. Every evaluation
# comes through this module (jaxamp/__init__.py imports it), so none finds them empty.
_RULE_MODULES = (first_order, higher_order)


def autocast(
    fun: Callable[..., Any],
    policy: PolicyLike = "mixed_bfloat16",
    *,
    rules: AutocastRules | None = None,
    residuals: str = "compute_dtype",
    overrides: Mapping[str, PolicyLike] | None = None,
) -> Callable[..., Any]:
    """Runs any JAX function with op-level mixed precision, like ``torch.autocast``.

    Each call traces ``fun`` on its arrays in their own dtypes, then evaluates
    the traced program with matmuls and convolutions on compute-dtype operands,
    numerically sensitive primitives in float32 and everything else in the dtype
    that arrives (see the Autocast guide, guides/autocast.md, and ``AutocastRules``). Arguments
    that are not arrays (Python numbers, strings, callables) are held static.
    Floating outputs come back in the dtypes they had in the traced program.

    Args:
      fun: the function, e.g. a Flax ``model.apply`` or an Equinox module.
      policy: a ``jaxamp.Policy`` or a spec for ``jaxamp.get_policy``;
        its ``compute_dtype`` is the matmuls' operand dtype.
      rules: the rule table; ``jaxamp.AUTOCAST_RULES`` when ``None``.
      residuals: what the backward pass may keep when the compute dtype is 16-bit,
        as in ``jaxamp.linen.apply_policy``: ``"compute_dtype"`` (16-bit
        activations and float32 statistics; float32 temporaries are recomputed),
        ``"dots"`` or ``"all"`` (JAX's default: fewer converts, more memory).
        See ``jaxamp.checkpoint_residuals``.
      overrides: named scopes to keep in float32, e.g. ``{"head": "float32"}``: each key
        a glob pattern matched against whole scope names (``jax.named_scope``, a Flax
        module's path) anywhere in an operation's name stack, covering everything below
        a match; each value a policy that narrows nothing (``"float32"``), as
        ``jaxamp.suggest_policy`` returns them. Operations there run exactly as traced.
        For 16-bit or float8 policies per layer, use ``jaxamp.linen.apply_policy`` or
        ``jaxamp.nnx.apply_policy``.

    Returns:
      A function with ``fun``'s signature; under delayed float8 scaling it also takes
      ``fp8_state=``, the state ``jaxamp.init_fp8_state`` makes, whose gradient is its
      next value (guides/fp8.md).

    Raises:
      TypeError: if ``fun`` is not callable or ``rules`` is not an ``AutocastRules``.
      ValueError: if ``policy`` names no policy, ``residuals`` no mode, or an override
        a policy that narrows something.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> def layer(w, x):
      ...     return jax.nn.log_softmax(x @ w)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> report = jaxamp.precision_report(autocast(layer, "mixed_bfloat16"))(w, x)
      >>> [(op.lhs_dtype, op.rhs_dtype, op.result_dtype) for op in report.ops]
      [('bfloat16', 'bfloat16', 'float32')]
      >>> jax.jit(autocast(layer))(w, x).dtype
      dtype('float32')
    """
    if not callable(fun):
        raise TypeError(f"autocast expects a callable, got {type(fun).__name__}: {fun!r}.")
    policy = get_policy(policy)
    rules = AUTOCAST_RULES if rules is None else rules
    if not isinstance(rules, AutocastRules):
        raise TypeError(
            f"rules must be a jaxamp.AutocastRules, got {type(rules).__name__}; start from "
            "dataclasses.replace(jaxamp.AUTOCAST_RULES, ...)."
        )
    config = AutocastConfig(policy, rules, float32_scopes=float32_scopes(overrides))
    if policy.fp8 is not None and policy.fp8.scaling == "delayed":
        run = interpreter(fun, config, residuals)  # takes the call's Store first
        return fp8_state.with_state(run, policy.fp8.amax_history_length)
    return interpreted(fun, config, residuals)


def float32_scopes(overrides: Mapping[str, PolicyLike] | None) -> tuple[str, ...]:
    """The scope patterns of ``autocast``'s ``overrides``, each checked: a string key whose
    policy narrows nothing."""
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"autocast's overrides must map scope patterns to policies, e.g. "
            f"{{'head': 'float32'}}; got {type(overrides).__name__}: {overrides!r:.80}."
        )
    for key, spec in overrides.items():
        if not isinstance(key, str) or not key.strip("/"):
            raise TypeError(
                f"An autocast override key must be a scope pattern (a non-empty str such as "
                f"'head' or 'encoder/*/attention'), got {key!r}. Module classes as keys are "
                "for jaxamp.linen.apply_policy and jaxamp.nnx.apply_policy."
            )
        if narrows(get_policy(spec)):
            raise ValueError(
                f"autocast keeps a scope in float32 only: the override {key!r}: {spec!r} "
                f"narrows ({get_policy(spec)}). Valid: 'float32' (or any policy in 32 bits); "
                "for 16-bit or float8 policies per layer use jaxamp.linen.apply_policy or "
                "jaxamp.nnx.apply_policy."
            )
    return tuple(overrides)


def _warn_unmatched(patterns: tuple[str, ...], closed: Any, fun: Any) -> None:
    """Warns about each override pattern that names no scope of the traced program: it
    keeps nothing in float32 (a typo, or a scope renamed since the advice was made)."""
    if not patterns:
        return
    paths = set(scope_paths(closed))
    for pattern in patterns:
        if not eqns_in_scopes(closed, [pattern]):
            names = sorted({part for path in paths for part in path.split("/") if part})
            shown = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "")
            warnings.warn(
                f"The autocast override {pattern!r} matched no named scope of "
                f"{getattr(fun, '__qualname__', fun)!s}, so it keeps nothing in float32. "
                f"Its scopes include: {shown or 'none'}.",
                stacklevel=4,
            )


def _callee_and_method(fun: Callable[..., Any]) -> tuple[Any, Callable[..., Any]]:
    """``(callee, method)``, called as ``method(callee, *args, **kwargs)``: a method bound
    to a graph node (an NNX module's) as the node (split like an argument) and its
    function; anything else as itself and its type's ``__call__``."""
    if inspect.ismethod(fun) and graphs.splitter_for(fun.__self__).is_node(fun.__self__):
        return fun.__self__, fun.__func__
    return fun, type(fun).__call__


def _as_float32_shape(x: Any) -> Any:
    """The shape of ``x``, in float32 if ``x`` is a 16-bit array."""
    dtype = FLOAT32 if is_16bit(x.dtype) else x.dtype
    return jax.ShapeDtypeStruct(x.shape, dtype)


def _wider_than_traced(value: Any, atom: Any) -> bool:
    return is_narrower(atom.aval.dtype, getattr(value, "dtype", None))


def interpreted(
    fun: Callable[..., Any],
    config: AutocastConfig,
    residuals: str,
    as_written: Callable[[Any], Any] | None = None,
) -> Callable[..., Any]:
    """``fun`` evaluated by the autocast interpreter with ``config``'s policy and rules.

    Shared by ``autocast`` and the policies' ``apply``. Non-array arguments are
    held static. Graph nodes (NNX's: ``fun`` itself, the object of a bound method, and
    the modules, ``nnx.Optimizer``, ``nnx.Rngs``, other ``nnx.Pytree`` objects and
    ``nnx.Variable`` leaves anywhere in the arguments' pytrees) are split together
    into their state, so the traced program is pure and references they share stay
    shared; the variables the call changes (BatchNorm statistics, RNG counts, an
    optimizer's step and moments) are put back into them afterwards, as a call
    outside the interpreter would: each call takes the registered splitter that knows
    a node among its arguments (``graphs.splitter_for``), or none.

    ``as_written`` (for the policies, whose layers run in 16 bits as traced) maps
    ``(callee, args, kwargs)`` to a context in which it runs as its author wrote it. Where the
    trace holds a 16-bit ``inf`` constant, the function is traced again in that
    context with float32 inputs, and each constant the 16-bit trace rounded to
    ``inf`` (``x + 1e5`` in float16) is evaluated with the value written there.
    """
    run = interpreter(fun, config, residuals, as_written)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return run(None, *args, **kwargs)

    return wrapped


def interpreter(
    fun: Callable[..., Any],
    config: AutocastConfig,
    residuals: str,
    as_written: Callable[[Any], Any] | None = None,
) -> Interpreted:
    """``interpreted``'s evaluation, taking the call's FP8 state (delayed scaling) first:
    ``interpreter(...)(store, *args, **kwargs)`` (``None``: none; see
    ``fp8_state.with_state``). The policies call it so, one call fewer on the way."""
    validate_residuals(residuals)
    if not is_narrow(config.policy.compute_dtype) or config.policy.fp8 is not None:
        # A float8 GEMM keeps its own residuals (its float8 operands and scales); the
        # compute_dtype mode's recomputation around it gave NaN gradients (tested).
        residuals = "all"
    callee, method = _callee_and_method(fun)
    return Interpreted(config, residuals, as_written, callee, method)


@dataclasses.dataclass(frozen=True)
class Interpreted:
    """What ``interpreter`` fixes for every call; each call makes the rest (its trace, the
    constants as written, its ``CallContext``) and passes it down."""

    config: AutocastConfig
    residuals: str
    as_written: Callable[[Any], Any] | None
    callee: Any
    method: Callable[..., Any]  # called as method(callee, *args, **kwargs)

    def __call__(self, store: fp8_state.Store | None, *args: Any, **kwargs: Any) -> Any:
        tree = (self.callee, args, kwargs)
        graph = graphs.splitter_for(tree)  # NO_GRAPH where no argument is a graph node
        nodes, state, others = graph.split(tree)
        arrays, rebuild_inputs = partition_arrays((state, others))
        traced, rebuild_outputs = self._traceable(graph, nodes, rebuild_inputs)
        closed = jax.make_jaxpr(traced)(*arrays)
        _warn_unmatched(self.config.float32_scopes, closed, self.method)
        written, consts = self._as_written(nodes, rebuild_inputs, arrays, closed)
        evaluate = checkpoint_residuals(
            _evaluation(
                closed, consts, written, self.config, store, arrays, self.as_written is not None
            ),
            self.residuals,
        )
        if store is not None and store.state is None:  # init_fp8_state: the GEMMs' keys
            jax.eval_shape(evaluate, arrays)
            return None
        out, new_state = rebuild_outputs[0](evaluate(arrays))
        nodes.update(new_state)
        return out

    def _traceable(
        self, graph: GraphSplitter, nodes: Nodes, rebuild_inputs: Any
    ) -> tuple[Callable[..., list[Any]], list[Callable[[Any], Any]]]:
        """``(traced, rebuild_outputs)``: the call as a pure function of its arrays (the
        nodes' state in, the state it changed out), and, once it is traced, the function
        from its outputs to ``(output, changed state)``."""
        rebuild_outputs: list[Callable[[Any], Any]] = []
        method = self.method

        def traced(*arrays: Any) -> list[Any]:
            state, others = rebuild_inputs(arrays)
            before = graph.state_values(state)
            (callee, args, kwargs), merged = nodes.merge(state, others)
            out = method(callee, *args, **kwargs)
            out_arrays, rebuild = partition_arrays((out, graph.changed_state(before, merged)))
            rebuild_outputs.append(rebuild)
            return out_arrays

        return traced, rebuild_outputs

    def _as_written(
        self, nodes: Nodes, rebuild_inputs: Any, arrays: list[Any], closed: Any
    ) -> tuple[dict[int, Any], list[Any]]:
        """``(written, consts)``: the values the program wrote for the literals a 16-bit
        trace rounded to ``inf``, and ``closed``'s constants, each such one as written
        (the function traced again in ``as_written``'s context, on float32 inputs)."""
        consts = list(closed.consts)
        if self.as_written is None or not (
            constants.rounded_to_inf(closed.jaxpr) or constants.consts_hold_inf(closed)
        ):
            return {}, consts
        as_written, method = self.as_written, self.method

        def traced_as_written(*arrays: Any) -> Any:
            state, others = rebuild_inputs(arrays)
            tree, _ = nodes.merge(state, others)
            callee, args, kwargs = tree
            with as_written(tree):
                return method(callee, *args, **kwargs)

        wide = jax.make_jaxpr(traced_as_written)(*map(_as_float32_shape, arrays))
        for i, value in constants.written_consts(closed, wide).items():
            consts[i] = value
        return constants.written_values(closed.jaxpr, wide.jaxpr), consts


def _evaluation(
    closed: Any,
    consts: list[Any],
    written: dict[int, Any],
    config: AutocastConfig,
    store: fp8_state.Store | None,
    arrays: list[Any],
    keep_wider: bool,
) -> Callable[[list[Any]], list[Any]]:
    """The evaluation of ``closed`` with the rules on the call's arrays (``consts`` closed
    over, not arguments, so the rules see their values), with a ``CallContext`` made for
    each evaluation: ``config``, the constants as written and the float8 ``store``.

    Outputs come back in their traced dtypes. ``keep_wider`` (the policies, whose layers
    are traced in 16 bits): an output a constant made wider than traced keeps its value
    (state a call writes, a sown ``h + 1e5``), where its 16-bit type would hold ``inf``."""

    kept = eqns_in_scopes(closed, config.float32_scopes)

    def evaluate_traced(traced_arrays: list[Any]) -> list[Any]:
        if store is not None:  # the arguments' names, for the float8 GEMMs' state
            fp8_state.rename(store, arrays, traced_arrays)
        weights = Weights() if config.policy.fp8 is not None else None
        context = CallContext(
            config, written, closed.jaxpr, store, float32_eqns=kept, weights=weights
        )
        outs = eval_jaxpr(closed.jaxpr, consts, traced_arrays, context)
        cast = cast_to_traced(outs, closed.jaxpr.outvars)
        if not keep_wider or (not written and not context.kept.noted):
            return cast
        wider = map(_wider_than_traced, outs, closed.jaxpr.outvars)
        return [out if wide else c for out, c, wide in zip(outs, cast, wider, strict=True)]

    return evaluate_traced


def autocast_float32(fun: Callable[..., Any]) -> Callable[..., Any]:
    """Marks ``fun`` to be evaluated exactly as traced inside ``autocast``.

    The calls ``fun`` makes run under ``jax.named_scope("jaxamp_float32")``;
    ``autocast`` casts the inputs of every primitive in that scope back to
    their traced dtypes, so a function traced in float32 (a sensitive matmul, a
    loss) runs in float32. Outside ``autocast`` it only names a scope.

    Args:
      fun: the function to keep as traced.

    Returns:
      ``fun``, wrapped.

    Raises:
      TypeError: if ``fun`` is not callable.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> @autocast_float32
      ... def head(w, x):
      ...     return x @ w
      >>> f = autocast(lambda w, x: head(w, x @ w), "mixed_bfloat16")
      >>> report = jaxamp.precision_report(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> [op.lhs_dtype for op in report.ops]
      ['bfloat16', 'float32']
    """
    if not callable(fun):
        raise TypeError(f"autocast_float32 expects a callable, got {type(fun).__name__}: {fun!r}.")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(FLOAT32_SCOPE):
            return fun(*args, **kwargs)

    return wrapped
