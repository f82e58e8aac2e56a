"""Applying a policy to an unmodified Flax Linen model."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
from flax.core import lift

from jaxamp._src.autocast.api import interpreted
from jaxamp._src.autocast.rules import AutocastConfig, AutocastRules, policy_rules
from jaxamp._src.backend import auto_policy
from jaxamp._src.errors import guide
from jaxamp._src.flax_policy import flax_internals
from jaxamp._src.flax_policy import fp8 as fp8_state
from jaxamp._src.flax_policy import plan as layer_plan
from jaxamp._src.ops.residuals import validate_residuals
from jaxamp._src.policy import Policy, PolicyLike, cast_floating, get_policy

# The chain of the layer whose method is running, so that a layer a model calls through
# ``Module.apply`` (a tied head: ``self.head.apply({"params": ...}, h)``), which Flax roots
# in a scope of its own, is found at the path it has in the model.
_RUNNING: contextvars.ContextVar[tuple[tuple[tuple[str, ...], nn.Module], ...]] = (
    contextvars.ContextVar("jaxamp_linen_running", default=())
)


# The policy, overrides and call of the policy module whose model is running, if any.
_OUTER: contextvars.ContextVar[tuple[Policy, tuple, Any] | None] = contextvars.ContextVar(
    "jaxamp_outer_policy", default=None
)


@dataclasses.dataclass
class _Call:
    """One call of a ``PolicyModule``: where its wrapped module sits, and the layers that ran.

    Attributes:
      base: the ``PolicyModule``'s path, which its wrapped module shares.
      inner: the wrapped module as bound in this call (set when the call starts).
      seen: each layer's ``(path, module)`` chain, in the order the layers ran.
    """

    base: tuple[str, ...]
    inner: Any = None
    seen: list[tuple[tuple[tuple[str, ...], nn.Module], ...]] = dataclasses.field(
        default_factory=list
    )


def _module_chain(module: nn.Module, call: _Call) -> tuple[tuple[tuple[str, ...], nn.Module], ...]:
    """``(path, module)`` from ``module`` up to the wrapped module of ``call``.

    Paths are the ones ``init`` sees, whatever scopes Flax binds the layers to in
    ``apply`` (where the policy's own lifted call roots them anew). A module that a
    running layer roots with ``Module.apply`` continues into that layer's chain, at
    the layer's path plus its own name.
    """
    chain = []
    while isinstance(module, nn.Module):
        scope = module.scope
        chain.append(((tuple(scope.path) if scope is not None else ()), module))
        if module is call.inner:
            break
        if isinstance(module.parent, nn.Module):
            module = module.parent
            continue
        running = _RUNNING.get()
        if running and not chain[-1][0] and module.name is not None:  # Module.apply in a layer
            prefix = (*running[0][0], module.name)
            return tuple((prefix + path, m) for path, m in chain) + running
        break
    if chain[-1][1] is call.inner:  # relative to the wrapped module, then at its path
        inner_path = chain[-1][0]
        chain = [(call.base + path[len(inner_path) :], m) for path, m in chain]
    return tuple(chain)


def _in_scan(before: Any, path: Any, module: nn.Module) -> bool:
    """Whether ``module``, called at ``path``, is the body of an ``nn.scan``: the layers
    called before it at that path (``before``, latest first) are lifted classes of it
    (``nn.remat``'s ``CheckpointCell``, earlier calls of it) up to a ``Scan<Body>``."""
    for seen_path, seen in (chain[0] for chain in before):
        if seen_path != path:
            continue
        if flax_internals.is_scan_body(seen, module):
            return True
        if not isinstance(seen, type(module)):
            return False
    return False


def _holds(owner: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` is a field of ``owner`` that Flax binds outside it (a layer
    passed in, not one ``owner`` defines)."""
    if module.parent is owner:
        return False
    for field in dataclasses.fields(owner):
        value: Any = getattr(owner, field.name, None)
        if value is module:
            return True
        same_layer = isinstance(value, nn.Module) and type(value) is type(module)
        if same_layer and value.name is not None and value.name == module.name:
            return True
    return False


def _cast_cache(module: nn.Module) -> None:
    """A decode cache made in another dtype (by the model alone: a checkpoint's) put in
    the layer's compute dtype, where the policy's own ``init`` makes it."""
    dtype, scope = getattr(module, "dtype", None), module.scope
    if dtype is None or scope is None or not scope.is_mutable_collection("cache"):
        return
    for name, value in scope.variables().get("cache", {}).items():
        cast = layer_plan.in_layer_dtype(value, dtype)
        if cast is not value:
            scope.put_variable("cache", name, cast)


def _lifted_policy(
    fn: Callable[..., Any],
    scope: Any,
    *args: Any,
    config: AutocastConfig,
    residuals: str,
    delayed: bool,
    **kwargs: Any,
) -> Any:
    """A Flax core transformation (like ``flax.core.lift.checkpoint``): ``fn`` evaluated by
    the autocast interpreter with ``config``, its variables and RNGs lifted through it.
    Under delayed float8 scaling (``delayed``), the layers' state goes in max-combined, one
    conversion per apply, so a layer run by several calls combines its state by max."""

    def inner(
        scope_fn: Callable[..., Any],
        repack_fn: Callable[..., Any],
        variable_groups: Any,
        rng_groups: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        def pure(variable_groups: Any, rng_groups: Any, *args: Any, **kwargs: Any) -> Any:
            scope = scope_fn(variable_groups, rng_groups)
            return fn(scope, *args, **kwargs), repack_fn(scope)

        # Under a policy that narrows nothing the program is evaluated as traced, its
        # constants included.
        as_written = None if config.as_traced else lambda _: layer_plan.layers_as_written()
        combined = fp8_state.max_combined_groups(variable_groups, delayed, scope, _TARGET)
        out, repacked = interpreted(pure, config, residuals, as_written)(
            combined, rng_groups, *args, **kwargs
        )
        return out, fp8_state.as_given_groups(repacked, variable_groups)

    lifted = lift.pack(inner, (True,), (True,), (True,), name="jaxamp_policy", enable_kwargs=True)
    return lifted(scope, *args, **kwargs)


_TARGET = "jaxamp_policy"  # the name of the lifted call, in the program's layer names


def _without_policy_modules(capture: Any) -> Any:
    """A ``capture_intermediates`` filter that leaves out the policy's own calls, so the
    captured intermediates are the wrapped module's, as without the policy."""
    if not capture:
        return capture
    if capture is True:
        keep = lambda module, method_name: method_name == "__call__"
    else:
        keep = capture

    def capture_filter(module: nn.Module, method_name: str) -> bool:
        return (
            not isinstance(module, PolicyModule)
            and method_name != _TARGET
            and keep(module, method_name)
        )

    return capture_filter


def _interceptor(
    root: Policy, overrides: tuple[tuple[Any, Policy], ...], call: _Call
) -> Callable[..., Any]:
    """The method interceptor that gives each layer its settings (see ``layer_plan.plan_layer``).

    Each layer's ``(path, module)`` chain is appended to ``call.seen``.
    """

    def intercept(
        next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        module = context.module
        if isinstance(module, PolicyModule) or layer_plan.running_as_written():
            return next_fun(*args, **kwargs)
        fp8_state.refuse_flax_fp8_op(module, (root, *(p for _, p in overrides)))
        chain = _module_chain(module, call)
        call.seen.append(chain)
        caller = _RUNNING.get()
        if caller and _holds(caller[0][1], module):
            # A layer passed to the running one (nn.RNN's cell, which Flax binds beside
            # it) runs under the running layer's override too, and so do its own layers.
            chain = chain + caller
        elif caller:
            top = next((i for i, (_, m) in enumerate(caller) if m is chain[-1][1]), None)
            if top is not None:
                chain = chain + caller[top + 1 :]
        # Flax calls an nn.scan body (a clone of the scanned class) after the Scan<Body>
        # layer at the same path; the running layer is not always that one.
        earlier = itertools.islice(reversed(call.seen), 1, 65)  # the 64 before, latest first
        scan_body = _in_scan(earlier, chain[0][0], module)
        token = _RUNNING.set(chain)
        try:
            out = run(chain, module, next_fun, args, kwargs, context)
        finally:
            _RUNNING.reset(token)
        if scan_body:  # an override may run the body wider than the carry it is given
            out = layer_plan.carry_as_given(module, context.method_name, args, out, True)
        return out

    def run(
        chain: tuple[tuple[tuple[str, ...], nn.Module], ...],
        module: nn.Module,
        next_fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Any,
    ) -> Any:
        policy = layer_plan.resolve_policy(root, overrides, chain)
        plan = layer_plan.plan_layer(module, policy, context.method_name)
        scope = layer_plan.layer_scope(root, policy)
        as_written = layer_plan.has_complex((args, kwargs)) or layer_plan.has_float64(
            (args, kwargs)
        )
        if not plan or as_written:  # complex or float64 inputs: the layer as written
            with scope:
                return next_fun(*args, **kwargs)
        with scope, flax_internals.temporarily_set(module, plan.attributes):
            _cast_cache(module)
            if plan.matmul is not None:
                out = layer_plan.run_unhooked(module, plan, *args, **kwargs)
            else:
                out = next_fun(*args, **kwargs)
        if plan.cast_output_to is not None:
            out = cast_floating(out, plan.cast_output_to)
        return layer_plan.carry_as_given(module, context.method_name, args, out)

    return intercept


def _root_policy(given: Policy, overrides: Any, module: nn.Module) -> Policy:
    """The policy of the wrapped model: an override of its own class is its policy (its
    inputs are cast to it), else the policy given."""
    return layer_plan.resolve_policy(given, overrides, [((), module)])


class PolicyModule(nn.Module):
    """A Linen module under a precision policy; itself a Linen module.

    Made by ``jaxamp.linen.apply_policy``. It shares its scope with the wrapped
    module, so ``init`` and ``apply`` take the same arguments as the wrapped
    module's and return variables of the same structure: checkpoints,
    ``TrainState.create(apply_fn=model.apply, ...)`` and ``method=`` keep working,
    and so do ``bind``, ``tabulate``, ``lazy_init`` and use as a submodule of
    another Linen module (its variables then sit where the bare module's would).
    The wrapped module's methods (``model.encode``, ``method="encode"``) run
    under the policy; its other attributes (config fields) are read through.

    Attributes:
      module: the unmodified Linen module.
      policy: the policy applied to it.
      overrides: ``(key, Policy)`` pairs, as given to ``apply_policy``.
      residuals: what the backward pass may save (see ``apply_policy``).
      rules: the rule table ``apply`` evaluates the model with (see ``apply_policy``).
      given_policy: the policy as given to ``apply_policy``, before an override of the
        model's own class replaced it (``clone`` starts from it).
    """

    module: nn.Module
    policy: Policy
    overrides: tuple[tuple[Any, Policy], ...] = ()
    residuals: str = "compute_dtype"
    rules: AutocastRules | None = None
    given_policy: Policy | None = None

    def setup(self) -> None:
        flax_internals.share_scope(self, self.module)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if name.startswith("_") or module is None or not hasattr(module, name):
                raise
            if callable(getattr(type(module), name, None)):
                return functools.partial(self._run, name)  # its method, under the policy
            return getattr(module, name)  # a field of the wrapped module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("__call__", *args, **kwargs)

    @nn.nowrap
    def sow(self, col: str, name: str, value: Any, *args: Any, **kwargs: Any) -> bool:
        """Flax's ``capture_intermediates`` records the wrapped module's calls; the policy
        module's own, at the same scope with the same values, are not recorded twice."""
        if col == "intermediates":
            return False
        return super().sow(col, name, value, *args, **kwargs)

    @nn.nowrap
    def clone(
        self,
        *,
        parent: Any = None,
        _deep_clone: bool | weakref.WeakValueDictionary = False,
        _reset_names: bool = False,
        **updates: Any,
    ) -> PolicyModule:
        """Like ``nn.Module.clone`` (``copy`` passes here too); a field of the wrapped module
        (``features=``, as read through) goes to a clone of the wrapped module, and the
        policy's settings are taken as ``apply_policy`` takes them."""
        own = {field.name for field in dataclasses.fields(self)}
        wrapped = {k: updates.pop(k) for k in list(updates) if k not in own}
        if wrapped:
            updates["module"] = updates.get("module", self.module).clone(**wrapped)
        # The settings as apply_policy takes them (a policy's name, a mapping), checked.
        if "given_policy" in updates and updates["given_policy"] is not None:
            updates["given_policy"] = get_policy(updates["given_policy"])
        if "policy" in updates:
            updates["policy"] = updates["given_policy"] = get_policy(
                updates["policy"] or auto_policy()
            )
        if "overrides" in updates:
            updates["overrides"] = layer_plan.normalize_overrides(updates["overrides"])
        if "residuals" in updates:
            validate_residuals(updates["residuals"])
        if "rules" in updates:
            policy_rules(updates["rules"])
        if {"policy", "overrides", "module"} & updates.keys():  # the model's class overridden
            given = updates.get("given_policy", self.given_policy or self.policy)
            updates["given_policy"] = given
            updates["policy"] = _root_policy(
                given, updates.get("overrides", self.overrides), updates.get("module", self.module)
            )
        return super().clone(
            parent=parent, _deep_clone=_deep_clone, _reset_names=_reset_names, **updates
        )

    @nn.nowrap
    def _run(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped module's ``method`` (a name or a function) under the policy."""
        # Shares the scope first, when ``init``/``apply`` call ``method`` bare.
        flax_internals.run_setup(self)
        self._check_nested()
        args, kwargs = self.policy.cast_to_compute((args, kwargs))
        call = _Call(tuple(self.scope.path) if self.scope is not None else ())
        interceptor = _interceptor(self.policy, self.overrides, call)

        def target(mdl: PolicyModule, *args: Any, **kwargs: Any) -> Any:
            inner = call.inner = mdl.module
            fn = getattr(type(inner), method) if isinstance(method, str) else method
            token = _OUTER.set((self.policy, self.overrides, call))
            try:
                with nn.intercept_methods(interceptor):
                    out = fn(inner, *args, **kwargs)
            finally:
                _OUTER.reset(token)
            # Cast in the program, where a value the policy kept wider than traced (a
            # constant float16 cannot hold) reaches the output dtype without the traced one.
            return self.policy.cast_to_output(out)

        target.__name__ = _TARGET

        with layer_plan.explaining_carry_errors(self.policy):
            if self.is_initializing():  # creating params: the layers' settings are all it needs
                out = target(self, *args, **kwargs)
            else:
                config = AutocastConfig(
                    self.policy, policy_rules(self.rules), tuple(p for _, p in self.overrides)
                )
                out = nn.transforms.lift_direct_transform(
                    functools.partial(
                        _lifted_policy,
                        config=config,
                        residuals=self.residuals,
                        delayed=self._scales_delayed(),
                    ),
                    (target,),
                    self,
                    *args,
                    multi_scope=True,
                    **kwargs,
                )
        # Only a whole-model call (another method may run part of the model) shows that an
        # override matches no layer; and only if the layers ran (were traced) in it.
        if self.overrides and call.seen and method == "__call__":
            layer_plan.warn_unmatched(self.overrides, call.seen, type(self.module).__name__)
        return out

    @nn.nowrap
    def _check_nested(self) -> None:
        """Refuses to run inside another policy's model with other settings than the outer
        policy gives it there: the outer policy's settings decide its layers (a nested
        policy module's dtypes, float8 and overrides did not apply, silently)."""
        outer = _OUTER.get()
        if outer is None:
            return
        root, overrides, call = outer
        there = layer_plan.resolve_policy(root, overrides, _module_chain(self, call))
        if (self.policy, self.overrides) == (there, ()):
            return
        path = "/".join(str(p) for p in self.scope.path) if self.scope else ""
        given = [f"'{path}': '{self.given_policy or self.policy}'"]
        for key, policy in self.overrides:
            name = key.__name__ if isinstance(key, type) else f"'{path}/{key}'"
            given.append(f"{name}: '{policy}'")
        given_text = ", ".join(given)
        raise ValueError(
            f"A policy module ('{self.policy}' on {type(self.module).__name__}) runs inside "
            f"a model under another policy, which gives it '{there}' at '{path}': the outer "
            "policy decides its layers, so its own dtypes, float8 setting and overrides "
            "would not apply. Give them as overrides of the outer policy, on the bare "
            f"module: overrides={{{given_text}}} (a class key applies to every instance in the "
            f"model; {guide('policies.md')})."
        )

    @nn.nowrap
    def _scales_delayed(self) -> bool:
        """Whether a policy of the model (the root's or an override's) is delayed float8."""
        policies = (self.policy, *(policy for _, policy in self.overrides))
        return any(p.fp8 is not None and p.fp8.scaling == "delayed" for p in policies)

    @nn.nowrap
    def _method(self, method: Any) -> Any:
        """``method`` of ``init``/``apply``, for the wrapped module, as a method of this one."""
        if method is None or getattr(method, "_jaxamp_policy_method", False):
            return method
        if isinstance(method, str) and method in type(self).__dict__:
            return method

        def run(self: PolicyModule, *args: Any, **kwargs: Any) -> Any:
            return self._run(method, *args, **kwargs)

        run.__dict__["_jaxamp_policy_method"] = True
        return run

    @nn.nowrap
    def init_with_output(
        self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any
    ) -> tuple[Any, Any]:
        """Like ``nn.Module.init_with_output``; params in each layer's ``param_dtype``."""
        return super().init_with_output(rngs, *args, method=self._method(method), **kwargs)

    @nn.nowrap
    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        """Like ``nn.Module.init``; params are created in each layer's ``param_dtype``."""
        return super().init(rngs, *args, method=self._method(method), **kwargs)

    @nn.nowrap
    def apply(self, variables: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        """Like ``nn.Module.apply``, with the policy; outputs come back in ``output_dtype``.

        Floating inputs are cast to the compute dtype (integer inputs such as token
        ids are left alone) and the output (not the updated mutable collections) to
        the output dtype. Params are used in the dtypes they come in: ``init``
        creates each layer's in its own ``param_dtype`` (overrides included), and
        each layer casts them to its compute dtype, so a float32 layer under a
        16-bit root computes with its float32 weights.
        """
        if "capture_intermediates" in kwargs:
            kwargs["capture_intermediates"] = _without_policy_modules(
                kwargs["capture_intermediates"]
            )
        out = super().apply(variables, *args, method=self._method(method), **kwargs)
        if kwargs.get("mutable", False) is not False:  # the state returned as it came in
            out, updated = out
            return fp8_state.float32_state(out), fp8_state.as_float32_collection(updated)
        return fp8_state.float32_state(out)  # a model returning its state: float32

    def __repr__(self) -> str:
        return f"PolicyModule({type(self.module).__name__}, policy='{self.policy}')"


def apply_policy(
    module: nn.Module,
    policy: PolicyLike | None = None,
    *,
    overrides: Mapping[str | type, PolicyLike] | None = None,
    residuals: str = "compute_dtype",
    rules: AutocastRules | None = None,
) -> PolicyModule:
    """Runs an unmodified Linen module under a precision policy.

    Every layer that follows Flax's conventions (``Dense``, ``DenseGeneral``,
    ``Einsum``, ``Conv``, ``ConvTranspose``, ``Embed``, the attention and
    normalisation layers, and your own modules that have ``dtype``/``param_dtype``
    fields) runs with ``dtype=compute_dtype`` and creates its params in
    ``param_dtype``; matmuls and convolutions run under jaxamp's 16-bit matmul rule
    (16-bit operands, float32 accumulation, forward and backward, float32 weight
    gradients; see the 16-bit matmul rule guide, guides/matmul-rule.md), attention's softmax
    and normalisation statistics are computed in float32, ``batch_stats`` stay float32.

    ``apply`` then evaluates the model with the rule table of ``jaxamp.autocast``:
    wherever the model calls them itself,
    numerically sensitive primitives (the exponentials and sums of a softmax
    written out or called from ``jax.nn``/``flax.linen`` directly, ``logsumexp``,
    ``erf``, losses) run in float32, a matmul the model writes on 16-bit values
    accumulates in float32, and a 16-bit value broadcast into an activation
    (a bias, a positional embedding) gets its gradient summed in float32.
    A matmul a custom module writes itself on a float32 param (``x @
    self.param(...)``) runs in the compute dtype too, under the matmul rule (the
    ``compute`` set of ``rules``), as ``jaxamp.autocast`` runs it.

    The policy is applied while the returned object's ``init``/``apply`` trace
    the module, so the module's code and its variables' structure are unchanged.

    Args:
      module: a Linen module.
      policy: a ``jaxamp.Policy`` or a spec for ``jaxamp.get_policy``;
        ``None`` picks ``jaxamp.auto_policy``.
      overrides: per-class or per-path policies, e.g. ``{"head": "float32"}`` or
        ``{nn.Dense: "float32"}``. A class key covers its instances and all
        modules inside them; a string is a glob pattern matched against module
        paths (``"head"``, ``"Dense_*"``, ``"encoder/*/attention"``), at the end
        of the path, covering the subtree below a match. The closest match wins.
      residuals: what the backward pass may keep under a 16-bit compute dtype:
        ``"compute_dtype"`` (default; float32 temporaries such as normalisation
        and softmax intermediates are recomputed from 16-bit values),
        ``"dots"`` (only matmul, convolution and reduction outputs are kept) or
        ``"all"`` (JAX's default). See ``jaxamp.checkpoint_residuals``.
      rules: the ``jaxamp.AutocastRules`` ``apply`` evaluates the model with
        (``jaxamp.AUTOCAST_RULES`` when ``None``): its ``float32`` and ``promote``
        sets, and its ``compute`` set for the matmuls the model writes itself (the
        layers' own matmuls take the rule through their hooks either way).

    Returns:
      A ``PolicyModule`` with ``init``, ``init_with_output`` and ``apply``.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxamp
      >>> model = jaxamp.linen.apply_policy(nn.Dense(3), "mixed_bfloat16")
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> variables["params"]["kernel"].dtype, model.apply(variables, jnp.ones((2, 4))).dtype
      (dtype('float32'), dtype('float32'))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"apply_policy expects a flax.linen.Module, got {type(module).__name__}: "
            f"{module!r:.80}. For flax.nnx modules use jaxamp.nnx.apply_policy."
        )
    if isinstance(module, PolicyModule):  # a second policy replaces the first
        module = module.module
    if policy is None:
        policy = auto_policy()
    policy_rules(rules)  # validates
    # A top-level model's wrapper takes the model's class name, so that the layer names
    # in its program read as the bare model's (``precision_report`` drops the wrapper's).
    name = type(module).__name__ if module.parent is None else None
    normalized = layer_plan.normalize_overrides(overrides)
    given = get_policy(policy)
    return PolicyModule(
        module,
        _root_policy(given, normalized, module),
        normalized,
        validate_residuals(residuals),
        rules,
        given,
        name=name,
    )
