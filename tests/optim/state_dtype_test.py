"""Tests for jaxamp/_src/optim/state_dtype.py: any optax state stored in 16 bits."""

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers.expected_warnings import FLOAT16_STATISTICS
from tests.helpers.promotion import OPTAX
from tests.helpers.train_steps import apply_step, dtypes_of, sample_params, traced_steps

# float16 statistics on purpose beside bfloat16 (the warning has its own test).
pytestmark = FLOAT16_STATISTICS

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _grads(step):
    return jax.tree.map(
        lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), step), p.shape),
        sample_params(),
    )


# float32 storage with stochastic rounding is left out: float32 state rounded to float32
# is the identity; test_float32_storage_is_plain_optax_bit_for_bit covers float32.
@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize(
    "dtype, rounding",
    [
        (d, r)
        for d in DTYPES
        for r in ("nearest", "stochastic")
        if (d, r) != (jnp.float32, "stochastic")
    ],
)
def test_adam_moments_in_dtype_counts_untouched_and_stable(dtype, rounding):
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), dtype, rounding=rounding)
    params = sample_params()
    state = tx.init(params)
    adam = state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(dtype)}
    assert adam.count.dtype == jnp.int32
    traces = []
    step = apply_step(tx, count_traces=traces)
    first = dtypes_of(state)
    for i in range(4):
        params, state = step(params, state, _grads(i))
        assert dtypes_of(state) == first  # dtypes (and structure) stable across steps
    assert len(traces) == 1  # one trace
    assert int(state.count) == 4 and int(state.inner_state[0].count) == 4


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_updates_follow_float32_adam(dtype):
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), {"mu": dtype, "nu": dtype})
    ref = optax.adam(1e-2)
    params = ours = sample_params()
    state, ref_state = tx.init(params), ref.init(params)
    for i in range(20):
        u, state = jax.jit(tx.update)(_grads(i), state, ours)
        ours = optax.apply_updates(ours, u)
        r, ref_state = ref.update(_grads(i), ref_state, params)
        params = optax.apply_updates(params, r)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)  # 20 steps of 1e-2: within 10% of a step


def test_per_field_dtypes_and_errors():
    tx = jaxamp.with_state_dtype(optax.adam(1e-3), {"mu": jnp.bfloat16})
    adam = tx.init(sample_params()).inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32
    momentum = jaxamp.with_state_dtype(optax.sgd(1e-2, momentum=0.9), {"trace": "bf16"})
    assert momentum.init(sample_params()).inner_state[0].trace["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"'nu_dtype'.*Valid choices: 'mu', 'nu'"):
        jaxamp.with_state_dtype(optax.adam(1e-3), {"nu_dtype": jnp.bfloat16}).init(sample_params())
    with pytest.raises(ValueError, match="Unknown rounding 'floor'"):
        jaxamp.with_state_dtype(optax.adam(1e-3), jnp.bfloat16, rounding="floor")
    with pytest.raises(ValueError, match="int8"):
        jaxamp.with_state_dtype(optax.adam(1e-3), "int8")
    with pytest.raises(TypeError, match="got str: 'adam'"):
        jaxamp.with_state_dtype("adam", jnp.bfloat16)


def test_stochastic_state_rounding_is_reproducible_and_unbiased():
    """An EMA whose per-step change is below half a bfloat16 ulp: to nearest it stalls,
    stochastically it follows float32 on average."""
    decay, steps = 0.9999, 3000
    params = {"w": jnp.zeros(4096)}
    grads = {"w": jnp.ones(4096)}
    ema32 = optax.ema(decay, debias=False)

    def run(tx):
        step = lambda _, state: tx.update(grads, state, params)[1]
        return jax.jit(lambda s: jax.lax.fori_loop(0, steps, step, s))(tx.init(params))

    expected = 1 - decay**steps  # about 0.26; to nearest, bfloat16 stalls near 0.03
    nearest = run(jaxamp.with_state_dtype(ema32, jnp.bfloat16)).inner_state.ema["w"]
    stochastic = run(jaxamp.with_state_dtype(ema32, jnp.bfloat16, rounding="stochastic"))
    again = run(jaxamp.with_state_dtype(ema32, jnp.bfloat16, rounding="stochastic"))
    s = stochastic.inner_state.ema["w"].astype(jnp.float32)
    np.testing.assert_array_equal(s, again.inner_state.ema["w"].astype(jnp.float32))
    assert abs(float(s.mean()) - expected) < 0.01
    assert abs(float(nearest.astype(jnp.float32).mean()) - expected) > 0.05  # it stalls


@pytest.mark.standard_promotion(OPTAX)
def test_masked_lookahead_and_single_array_params():
    """Statistics are found in subtrees shaped like the params: under optax.masked (its
    MaskedNode placeholders in them), under optax.lookahead (shaped like the fast params,
    a part of its LookaheadParams), and for params that are one array, where scalar
    hyperparameters do not have the param's shape."""
    params = sample_params()
    masked = optax.masked(optax.adam(1e-2), {"w": True, "b": False})
    state = jaxamp.with_state_dtype(masked, jnp.bfloat16).init(params)
    adam = state.inner_state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and isinstance(adam.mu["b"], optax.MaskedNode)
    look = jaxamp.with_state_dtype(optax.lookahead(optax.adam(1e-2), 5, 0.5), jnp.bfloat16)
    both = optax.LookaheadParams.init_synced(params)
    state = look.init(both)
    _, new = jax.jit(look.update)(_grads(0), state, both)  # updates for the fast params
    for s in (state, new):
        adam = s.inner_state.fast_state[0]
        assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(jnp.bfloat16)}
    assert dtypes_of(new) == dtypes_of(state)
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = jaxamp.with_state_dtype(adam, jnp.bfloat16)
    _, state, dtypes, traces = traced_steps(tx, params["w"], 3)  # params: one array
    inner = state.inner_state
    assert inner.hyperparams["b2"].dtype == jnp.float32
    assert inner.inner_state[0].mu.dtype == jnp.bfloat16
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fields_not_named_keep_their_dtype_and_the_step_traces_once(param_dtype, rounding):
    """With {"mu": bfloat16} and 16-bit params, nu starts in the params' dtype: it must stay
    there (it went to float32 after the first step, and the step traced twice)."""
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), {"mu": jnp.bfloat16}, rounding=rounding)
    params = jax.tree.map(lambda p: p.astype(param_dtype), sample_params())
    params, state, dtypes, traces = traced_steps(tx, params, 4, grads_dtype=param_dtype)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == param_dtype
    assert dtypes[1:] == dtypes[:1] * 4
    assert traces == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float32_storage_is_plain_optax_bit_for_bit(rounding):
    """Float32 storage rounds nothing: params and state are exactly plain optax's."""
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), jnp.float32, rounding=rounding)
    ref = optax.adam(1e-2)
    ours, state, _, _ = traced_steps(tx, sample_params(), 5)
    theirs, ref_state, _, _ = traced_steps(ref, sample_params(), 5)
    for a, b in zip(
        jax.tree.leaves((ours, state.inner_state)),
        jax.tree.leaves((theirs, ref_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_MASK = {"a": True, "b": False, "c": {"d": True}}
_LABELS = {"a": "x", "b": "y", "c": {"d": "x"}}


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, {"mu": jnp.bfloat16, "nu": jnp.bfloat16}])
def test_inside_masked_and_multi_transform(wrapper, flat, dtype):
    """with_state_dtype inside optax.masked or optax.multi_transform sees params with
    MaskedNode placeholders: every unmasked param's moments are cast, the top-level ones
    too (they stayed float32; with flat params nothing was cast, and a per-field dtype
    raised "no state field ... named 'mu' ... Valid choices: .")."""
    params = {"a": jnp.ones((3, 2)), "b": jnp.ones(2), "c": {"d": jnp.ones(4)}}
    mask, labels = _MASK, _LABELS
    if flat:
        params, mask, labels = (
            {k: v for k, v in t.items() if k != "c"} for t in (params, mask, labels)
        )
    inner = jaxamp.with_state_dtype(optax.adam(1e-2), dtype)
    if wrapper == "masked":
        tx = optax.masked(inner, mask)
        adam_of = lambda s: s.inner_state.inner_state[0]
    else:
        tx = optax.multi_transform({"x": inner, "y": optax.sgd(1e-2)}, labels)
        adam_of = lambda s: s.inner_states["x"].inner_state.inner_state[0]
    params, state, dtypes, traces = traced_steps(tx, params, 3)
    adam = adam_of(state)
    unmasked = ["a", "d"] if not flat else ["a"]
    moments = [m["a"] for m in (adam.mu, adam.nu)]
    if not flat:
        moments += [m["c"]["d"] for m in (adam.mu, adam.nu)]
    assert [x.dtype for x in moments] == [np.dtype(jnp.bfloat16)] * 2 * len(unmasked)
    assert isinstance(adam.mu["b"], optax.MaskedNode)
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, {"mu": jnp.bfloat16}])
def test_flattened_statistics_are_cast(dtype):
    """optax.flatten keeps Adam's moments as one vector of the params' total size: they
    are per-parameter statistics (they stayed float32, silently; a per-field dtype
    raised "Valid choices: ." with no field in it)."""
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = jaxamp.with_state_dtype(optax.flatten(optax.adam(1e-2)), dtype)
    params, state, dtypes, traces = traced_steps(tx, params, 3)
    adam = state.inner_state[0]
    assert adam.mu.shape == (15,) and adam.mu.dtype == jnp.bfloat16
    assert adam.nu.dtype == (jnp.float32 if isinstance(dtype, dict) else jnp.bfloat16)
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


def test_nothing_to_cast_warns_and_field_errors_name_the_fields_found():
    """A with_state_dtype that finds no per-parameter statistic in a state with floating
    leaves says so at init, naming the transformation; an unknown field lists the
    fields that hold statistics (or the floating leaves, when none does)."""
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones(3)}
    plateau = optax.contrib.reduce_on_plateau()
    with pytest.warns(UserWarning, match=r"reduce_on_plateau.*found no per-parameter"):
        jaxamp.with_state_dtype(plateau, jnp.bfloat16).init(params)
    no_statistic = r"reduce_on_plateau.*'mu'.*ReduceLROnPlateauState.*\.scale \(\)"
    with pytest.raises(ValueError, match=no_statistic):
        jaxamp.with_state_dtype(plateau, {"mu": jnp.bfloat16}).init(params)
    with pytest.raises(ValueError, match=r"'m'.*Valid choices: 'mu', 'nu'\.$"):
        jaxamp.with_state_dtype(optax.flatten(optax.adam(1e-2)), {"m": jnp.bfloat16}).init(params)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_around_loss_scaled_is_refused_at_init_and_inside_it_keeps_the_master(dtype):
    """with_state_dtype(loss_scaled(...)) stored the float32 master in 16 bits: 400 steps
    of 2**-13 from 1.0 stayed at 1.0 in bfloat16 params. Refused at init; the order that
    works ends where float32 does."""
    params = jnp.ones(4, jnp.bfloat16)
    wrong = jaxamp.with_state_dtype(jaxamp.loss_scaled(optax.sgd(2.0**-13)), dtype)
    with pytest.raises(ValueError, match=r"jaxamp\.loss_scaled\(jaxamp\.with_state_dtype"):
        wrong.init(params)
    tx = jaxamp.loss_scaled(
        jaxamp.with_state_dtype(
            optax.chain(optax.trace(decay=0.0), optax.scale(-(2.0**-13))), dtype
        ),
        jaxamp.NoOpLossScale(),
    )
    state = tx.init(params)
    step, grads = apply_step(tx), jnp.ones(4, jnp.bfloat16)
    for _ in range(400):
        params, state = step(params, state, grads)
    assert float(state.master_params[0]) == 1.0 - 400 * 2.0**-13  # 0.951171875, exact
    assert params.dtype == jnp.bfloat16
    assert float(params[0]) == float(jnp.bfloat16(1.0 - 400 * 2.0**-13))


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_copies_of_the_params_are_never_cast(dtype):
    """SAM's cache and Prodigy's params0 are copies of the params, not statistics: SAM
    resets the params from its cache every sync, and Prodigy's learning-rate estimate
    reads params0. Rounded, SAM's float32 params drifted 0.0127 in 20 steps and
    Prodigy's estimate was 0.240 against 0.058."""
    params = sample_params()
    sam = optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2)
    with pytest.warns(UserWarning, match=r"copies of the params or gradients, never cast: \.cache"):
        state = jaxamp.with_state_dtype(sam, dtype).init(params)
    assert {x.dtype for x in jax.tree.leaves(state.inner_state.cache)} == {np.dtype("float32")}
    plain, _, _, _ = traced_steps(sam, params, 20)
    with pytest.warns(UserWarning):
        wrapped, _, _, _ = traced_steps(jaxamp.with_state_dtype(sam, dtype), params, 20)
    for got, want in zip(jax.tree.leaves(wrapped), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, want)  # SAM(sgd) keeps no statistic at all


@pytest.mark.standard_promotion(OPTAX)
def test_prodigys_initial_params_are_never_cast():
    """Prodigy's learning-rate estimate reads params0: rounded to bfloat16, it was 0.240
    against float32's 0.058. (float16 is left out: Prodigy's statistics start near its
    d0 = 1e-6 and underflow there, which is float16's range, not a copy rounded.)"""
    params = sample_params()
    prodigy = optax.contrib.prodigy(1.0)
    _, want, _, _ = traced_steps(prodigy, params, 20)
    _, got, _, _ = traced_steps(jaxamp.with_state_dtype(prodigy, jnp.bfloat16), params, 20)
    assert {x.dtype for x in jax.tree.leaves(got.inner_state.params0)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(got.inner_state.exp_avg)} == {np.dtype("bfloat16")}
    np.testing.assert_allclose(got.inner_state.estim_lr, want.estim_lr, rtol=0.05)


@pytest.mark.standard_promotion(OPTAX)
def test_copies_are_found_under_jit_and_in_nested_states():
    """Which leaves are copies is read from the jaxpr of init, so it holds when init is
    traced, and through chains and schedule-free's z."""
    params = sample_params()
    tx = jaxamp.with_state_dtype(
        optax.chain(optax.clip(1.0), optax.contrib.schedule_free_adamw(1e-3)), jnp.bfloat16
    )
    state = jax.jit(tx.init)(params)
    free = state.inner_state[1]
    assert {x.dtype for x in jax.tree.leaves(free.z)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(free.base_optimizer_state[0].nu)} == {
        np.dtype("bfloat16")
    }


@pytest.mark.standard_promotion(OPTAX)
def test_optimizer_wide_scalars_of_a_scalar_param_are_never_cast():
    """With one scalar param every scalar leaf has the param's shape: Prodigy's estim_lr
    and numerator were cast to bfloat16 for a bare scalar and not for {"w": scalar}.
    A statistic follows the params' shape; an optimizer-wide scalar does not."""
    for params in (jnp.float32(1.0), {"w": jnp.float32(1.0)}):
        state = jaxamp.with_state_dtype(optax.contrib.prodigy(), jnp.bfloat16).init(params)
        inner = state.inner_state
        assert inner.estim_lr.dtype == inner.numerator_weighted.dtype == jnp.float32
        assert {x.dtype for x in jax.tree.leaves(inner.exp_avg)} == {np.dtype("bfloat16")}


# Copies of the params or the gradients that ``update`` writes, or that ``init`` carries
# through a loop, are never statistics (issue 46). The reference is plain float32 optax,
# or the same transformation unwrapped: these states hold no statistic, so the wrapped run
# is float32's bit for bit.

_W = jnp.linspace(1.0, 10.0, 8)
_T = jnp.linspace(-2.0, 3.0, 8)


def _quadratic(params):
    return 0.5 * jnp.sum(_W * (params["x"] - _T) ** 2)


def _rosenbrock(params):
    x = params["x"]
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


_PROBLEMS = {"quadratic": (_quadratic, 8, 20), "rosenbrock": (_rosenbrock, 4, 60)}


def _line_search_run(tx, fun, params, steps, from_state):
    """``steps`` jitted L-BFGS steps, as optax's docs write them: the loss and gradient
    from ``optax.value_and_grad_from_state`` (the line search's, reused) or computed."""
    if from_state:
        value_and_grad = optax.value_and_grad_from_state(fun)
    else:
        value_and_grad = lambda p, state: jax.value_and_grad(fun)(p)

    @jax.jit
    def step(params, state):
        value, grad = value_and_grad(params, state=state)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fun)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params, state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("from_state", [False, True], ids=["computed", "from_state"])
@pytest.mark.parametrize("problem", sorted(_PROBLEMS))
def test_lbfgs_reaches_what_float32_optax_reaches(problem, from_state, dtype):
    """optax.lbfgs stores the last params and gradient during update (zeros at init), and
    its line search the last gradient: init's shapes took them for statistics and rounded
    them, and L-BFGS stalled (the Rosenbrock at 1.3e-4 in bfloat16, 0.12 in float16, where
    float32 optax reaches 0; through value_and_grad_from_state the step did not trace).
    L-BFGS keeps no statistic: every leaf stays float32 and the run is float32 optax's."""
    fun, size, steps = _PROBLEMS[problem]
    params = {"x": jnp.zeros(size)}
    want, _ = _line_search_run(optax.lbfgs(), fun, params, steps, from_state)
    assert float(fun(want)) < 1e-10  # the reference converges
    tx = jaxamp.with_state_dtype(optax.lbfgs(), dtype)
    copies = r"copies of the params or gradients, never cast: .*\.params.*\.updates.*\.grad"
    with pytest.warns(UserWarning, match=copies):
        got, state = _line_search_run(tx, fun, params, steps, from_state)
    np.testing.assert_array_equal(got["x"], want["x"])
    assert float(fun(got)) == float(fun(want))
    floating = [
        x for x in jax.tree.leaves(state.inner_state) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert {x.dtype for x in floating} == {np.dtype("float32")}


class _CopyState(NamedTuple):
    copy: Any  # params or gradients, not a statistic


def _filled_through_a_loop(params, loop):
    """The params, carried through a loop: they reach the carry on its second trip."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    body = lambda carry: (carry[1], params)
    if loop == "fori_loop":  # static bounds: lowered to a scan
        return jax.lax.fori_loop(0, 2, lambda _, c: body(c), (zeros, zeros))[0]
    return jax.lax.scan(lambda c, _: (body(c), None), (zeros, zeros), length=2)[0][0]


def _anchored_sgd(loop):
    """SGD pulled back toward the initial params, which init copies through a loop."""

    def init(params):
        return _CopyState(_filled_through_a_loop(params, loop))

    def update(updates, state, params):
        pull = lambda g, p, a: -0.1 * (g + 0.5 * (p - a))
        return jax.tree.map(pull, updates, params, state.copy), state

    return optax.GradientTransformation(init, update)


def _primal_averaging(loop):
    """Schedule-free's primal sequence on its own: z (a copy of the params, which init
    carries through a loop) takes the SGD steps, and the params move halfway to it."""

    def init(params):
        return _CopyState(_filled_through_a_loop(params, loop))

    def update(updates, state, params):
        z = jax.tree.map(lambda z, g: z - 0.1 * g, state.copy, updates)
        return jax.tree.map(lambda z, p: 0.5 * (z - p), z, params), _CopyState(z)

    return optax.GradientTransformation(init, update)


def _gradient_difference():
    """SGD on the gradient and its change since the last step (Adan's ``g``, L-BFGS's
    ``updates``): update stores the last gradient over init's zeros."""

    def init(params):
        return _CopyState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        step = lambda g, last: -0.05 * (g + 0.5 * (g - last))
        return jax.tree.map(step, updates, state.copy), _CopyState(updates)

    return optax.GradientTransformation(init, update)


_COPYING = {
    "anchored_sgd-fori_loop": lambda: _anchored_sgd("fori_loop"),
    "anchored_sgd-scan": lambda: _anchored_sgd("scan"),
    "primal_averaging-fori_loop": lambda: _primal_averaging("fori_loop"),
    "primal_averaging-scan": lambda: _primal_averaging("scan"),
    "gradient_difference": _gradient_difference,
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(_COPYING))
def test_copies_of_the_params_or_gradients_are_never_cast(name, dtype):
    """A copy of the params that init carries through a fori_loop or scan (zeros on the
    loop's first trip), or the last gradient that update stores over init's zeros, was
    taken for a statistic and rounded: the wrapped run left float32's. These states hold
    no statistic: the run is the unwrapped float32 one, bit for bit."""
    params = sample_params()
    want, _, _, _ = traced_steps(_COPYING[name](), params, 5)
    with pytest.warns(UserWarning, match=r"copies of the params or gradients, never cast: \.copy"):
        tx = jaxamp.with_state_dtype(_COPYING[name](), dtype)
        got, state, dtypes, traces = traced_steps(tx, params, 5)
    assert {x.dtype for x in jax.tree.leaves(state.inner_state.copy)} == {np.dtype("float32")}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert dtypes[1:] == dtypes[:1] * 5 and traces == 1


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_adans_last_gradient_is_never_cast_and_its_statistics_are(dtype):
    """optax.adan keeps the last gradient (``g``, rounded with them) beside its three
    statistics (``m``, ``v``, ``n``: still statistics)."""
    tx = jaxamp.with_state_dtype(optax.adan(1e-2), dtype)
    _, state, dtypes, traces = traced_steps(tx, sample_params(), 3)
    adan = state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves(adan.g)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves((adan.m, adan.v, adan.n))} == {np.dtype(dtype)}
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1


class _TraceState(NamedTuple):
    trace: Any


def _momentum_through_a_linear_solve():
    """Momentum whose new value comes out of lax.custom_linear_solve (the identity)."""

    def init(params):
        return _TraceState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        def new(t, g):
            solve = lambda matvec, b: b
            return jax.lax.custom_linear_solve(lambda x: x, 0.9 * t + g, solve, symmetric=True)

        trace = jax.tree.map(new, state.trace, updates)
        return jax.tree.map(lambda t: -0.01 * t, trace), _TraceState(trace)

    return optax.GradientTransformation(init, update)


def _momentum_that_needs_a_scale():
    """Momentum whose update takes an extra argument of its own, ``scale=``."""

    def init(params):
        return _TraceState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None, *, scale):
        trace = jax.tree.map(lambda t, g: 0.9 * t + scale * g, state.trace, updates)
        return jax.tree.map(lambda t: -0.01 * t, trace), _TraceState(trace)

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_what_cannot_be_read_is_refused_by_name_unless_the_fields_are_named(dtype):
    """Where update's data flow cannot be read (through a primitive jaxamp does not read,
    or an update that cannot be traced without its own extra arguments), a state leaf
    shaped like the params may be a copy: one dtype for all is refused at init, naming
    what hides it and the fields to name; a dtype per field is the caller's decision."""
    params = sample_params()
    cases = {
        "custom_linear_solve": _momentum_through_a_linear_solve,
        "keyword-only argument: 'scale'": _momentum_that_needs_a_scale,
    }
    for why, make in cases.items():
        with pytest.raises(ValueError, match=rf"{why}.*\{{'trace': jnp\.{np.dtype(dtype).name}\}}"):
            jaxamp.with_state_dtype(make(), dtype).init(params)
    tx = jaxamp.with_state_dtype(_momentum_through_a_linear_solve(), {"trace": dtype})
    _, state, dtypes, traces = traced_steps(tx, params, 3)
    assert {x.dtype for x in jax.tree.leaves(state.inner_state.trace)} == {np.dtype(dtype)}
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1
    state = jaxamp.with_state_dtype(_momentum_that_needs_a_scale(), {"trace": dtype}).init(params)
    assert {x.dtype for x in jax.tree.leaves(state.inner_state.trace)} == {np.dtype(dtype)}


@pytest.mark.standard_promotion(OPTAX)
def test_float16_statistics_warn_that_squared_gradients_flush():
    """Adam's nu in float16: a squared gradient of 1e-4 is below float16's smallest
    value, so nu flushes to zero and the update divides by eps alone (4.7x float32
    optax's). Said at init; bfloat16 says nothing."""
    params = {"w": jnp.zeros(1000)}
    with pytest.warns(UserWarning, match=r"float16.*flushes to\s+zero"):
        jaxamp.with_state_dtype(optax.adam(1e-3), jnp.float16).init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxamp.with_state_dtype(optax.adam(1e-3), jnp.bfloat16).init(params)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_float64_statistics_are_left_as_written_under_x64(dtype):
    """Under x64 a float64 param's statistics stay float64, step for step with float64
    optax (the reference); a float32 param's beside it are stored in ``dtype``."""
    with jax.enable_x64(True):
        params = {
            "a": jnp.linspace(-1, 1, 8, dtype=jnp.float64) + 1e-12,
            "c": jnp.linspace(-1, 1, 8, dtype=jnp.float32),
        }
        grads = jax.tree.map(lambda p: p * 0.5 + 1e-10, params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # float16's warning
            tx = jaxamp.with_state_dtype(optax.adam(1e-3), dtype)
            state = tx.init(params)
        plain = optax.adam(1e-3)
        plain_state = plain.init(params)
        for _ in range(3):
            updates, state = jax.jit(tx.update)(grads, state, params)
            want, plain_state = plain.update(grads, plain_state, params)
        mu = state.inner_state[0].mu
        assert mu["a"].dtype == jnp.float64 and mu["c"].dtype == np.dtype(dtype)
        assert updates["a"].dtype == jnp.float64
        np.testing.assert_allclose(updates["a"], want["a"], rtol=0, atol=1e-15)
