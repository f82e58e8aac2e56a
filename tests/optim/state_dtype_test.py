"""Tests for jaxamp/_src/optim/state_dtype.py: any optax state stored in 16 bits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _params():
    return {"w": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros(32)}


def _grads(step):
    return jax.tree.map(
        lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), step), p.shape), _params()
    )


def _dtypes(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


# float32 storage with stochastic rounding is left out: float32 state rounded to float32
# is the identity; test_float32_storage_is_plain_optax_bit_for_bit covers float32.
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
    params = _params()
    state = tx.init(params)
    adam = state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(dtype)}
    assert adam.count.dtype == jnp.int32
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    first = _dtypes(state)
    for i in range(4):
        params, state = step(params, state, _grads(i))
        assert _dtypes(state) == first  # dtypes (and structure) stable across steps
    assert len(traces) == 1  # one trace
    assert int(state.count) == 4 and int(state.inner_state[0].count) == 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_updates_follow_float32_adam(dtype):
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), {"mu": dtype, "nu": dtype})
    ref = optax.adam(1e-2)
    params = ours = _params()
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
    adam = tx.init(_params()).inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32
    momentum = jaxamp.with_state_dtype(optax.sgd(1e-2, momentum=0.9), {"trace": "bf16"})
    assert momentum.init(_params()).inner_state[0].trace["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"'nu_dtype'.*Valid choices: 'mu', 'nu'"):
        jaxamp.with_state_dtype(optax.adam(1e-3), {"nu_dtype": jnp.bfloat16}).init(_params())
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


@pytest.mark.parametrize("name", list(jaxamp.optim.OPTIMIZER_RECIPES))
def test_named_recipes_give_a_policy_and_an_optimizer(name):
    import flax.linen as nn

    policy, tx = jaxamp.optimizer_recipe(name, optax.adam(1e-2))
    model = jaxamp.linen.apply_policy(nn.Dense(3), policy)
    x = jnp.ones((4, 5))
    params = model.init(jax.random.key(0), x)["params"]
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
        value, grads = jaxamp.value_and_grad(loss)(params, opt_state=state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(5):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    expected = jnp.float32 if name == "float32_params" else jnp.bfloat16
    assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype(expected)}
    with pytest.raises(ValueError, match=r"Unknown optimizer recipe 'sr'\. Valid choices"):
        jaxamp.optimizer_recipe("sr", optax.adam(1e-2))


def _traced_steps(tx, params, steps, grads_dtype=jnp.float32):
    """``steps`` jitted updates of ``tx``: the params, the dtypes of the state after
    ``init`` and after each step, and how many times the step was traced."""
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    dtypes = [_dtypes(state)]
    for i in range(steps):
        key = jax.random.fold_in(jax.random.key(1), i)
        grads = jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape, grads_dtype), params)
        params, state = step(params, state, grads)
        dtypes.append(_dtypes(state))
    return params, state, dtypes, len(traces)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_hyperparameters_weight_sums_and_counters_are_never_cast(dtype, rounding):
    """inject_hyperparams' b2 = 0.999 is 1.0 in bfloat16 (Adam's update is then NaN);
    schedule_free's weight_sum, b1 and max_lr are scalars too: all stay float32, and
    only the per-parameter statistics (mu, nu, z) take ``dtype``."""
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=0.999)
    tx = jaxamp.with_state_dtype(adam, dtype, rounding=rounding)
    params, state, dtypes, traces = _traced_steps(tx, _params(), 5)
    hyper = state.inner_state.hyperparams
    assert {x.dtype for x in jax.tree.leaves(hyper)} == {np.dtype(jnp.float32)}
    assert float(hyper["b2"]) == np.float32(0.999)
    moments = state.inner_state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((moments.mu, moments.nu))} == {np.dtype(dtype)}
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
    assert dtypes[1:] == dtypes[:1] * 5 and traces == 1
    free = jaxamp.with_state_dtype(
        optax.contrib.schedule_free(optax.sgd(1.0), 1e-2), dtype, rounding=rounding
    )
    params, state, dtypes, traces = _traced_steps(free, _params(), 5)
    sf = state.inner_state
    assert {sf.b1.dtype, sf.weight_sum.dtype, sf.max_lr.dtype} == {np.dtype(jnp.float32)}
    assert sf.step_count.dtype == jnp.int32
    assert {x.dtype for x in jax.tree.leaves(sf.z)} == {np.dtype(dtype)}
    assert float(sf.weight_sum) > 0 and dtypes[1:] == dtypes[:1] * 5 and traces == 1


def test_bf16_stochastic_recipe_trains_inject_hyperparams_adam():
    """The 6-bytes recipe with an injected learning rate: the loss goes down and the
    params stay finite (with b2 rounded to 1.0 they went NaN at the first step)."""
    import flax.linen as nn

    policy, tx = jaxamp.optimizer_recipe(
        "bf16_stochastic", optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    )
    model = jaxamp.linen.apply_policy(nn.Dense(3), policy)
    x = jax.random.normal(jax.random.key(3), (16, 5))
    params = model.init(jax.random.key(0), x)["params"]
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss = lambda p: jnp.mean((model.apply({"params": p}, x) - 1.0) ** 2)
        value, grads = jaxamp.value_and_grad(loss)(params, opt_state=state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(10):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
    hyper = state.inner_state.inner_state.hyperparams
    assert float(hyper["b2"]) == np.float32(0.999) and hyper["b2"].dtype == jnp.float32


def test_masked_lookahead_and_single_array_params():
    """Statistics are found in subtrees shaped like the params: under optax.masked (its
    MaskedNode placeholders in them), under optax.lookahead (shaped like the fast params,
    a part of its LookaheadParams), and for params that are one array, where scalar
    hyperparameters do not have the param's shape."""
    params = _params()
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
    assert _dtypes(new) == _dtypes(state)
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = jaxamp.with_state_dtype(adam, jnp.bfloat16)
    _, state, dtypes, traces = _traced_steps(tx, params["w"], 3)  # params: one array
    inner = state.inner_state
    assert inner.hyperparams["b2"].dtype == jnp.float32
    assert inner.inner_state[0].mu.dtype == jnp.bfloat16
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fields_not_named_keep_their_dtype_and_the_step_traces_once(param_dtype, rounding):
    """With {"mu": bfloat16} and 16-bit params, nu starts in the params' dtype: it must stay
    there (it went to float32 after the first step, and the step traced twice)."""
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), {"mu": jnp.bfloat16}, rounding=rounding)
    params = jax.tree.map(lambda p: p.astype(param_dtype), _params())
    params, state, dtypes, traces = _traced_steps(tx, params, 4, grads_dtype=param_dtype)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == param_dtype
    assert dtypes[1:] == dtypes[:1] * 4
    assert traces == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float32_storage_is_plain_optax_bit_for_bit(rounding):
    """Float32 storage rounds nothing: params and state are exactly plain optax's."""
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), jnp.float32, rounding=rounding)
    ref = optax.adam(1e-2)
    ours, state, _, _ = _traced_steps(tx, _params(), 5)
    theirs, ref_state, _, _ = _traced_steps(ref, _params(), 5)
    for a, b in zip(
        jax.tree.leaves((ours, state.inner_state)),
        jax.tree.leaves((theirs, ref_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_stochastic_recipe_rounds_params_and_state_with_independent_bits():
    """optimizer_recipe("bf16_stochastic"): the param and its optimizer state, both at the
    same value halfway between two bfloat16 neighbours, round up or down independently
    (agree in about half the elements; with the same bits they agreed in all)."""
    n = 1 << 14
    x = 1.0 + (2 * jnp.arange(n) % 128 + 1) * 2.0**-8  # halfway between bfloat16 neighbours
    _, tx = jaxamp.optimizer_recipe(
        "bf16_stochastic", optax.trace(decay=0.9), loss_scale=jaxamp.StaticLossScale(1.0)
    )
    params = {"w": jnp.zeros(n, jnp.bfloat16)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": x}, state, params)  # trace = g; update = g
    new = optax.apply_updates(params, updates)["w"].astype(jnp.float32)
    trace = state.inner_state.inner_state.trace["w"].astype(jnp.float32)
    assert bool(jnp.all(new != x)) and bool(jnp.all(trace != x))  # every one was rounded
    agree = float(jnp.mean((new > x) == (trace > x)))
    assert abs(agree - 0.5) < 0.05, agree  # 0.5 +- 0.004 (1 SE) for independent bits
    assert abs(float(jnp.mean(new > x)) - 0.5) < 0.05  # each unbiased on its own


_MASK = {"a": True, "b": False, "c": {"d": True}}
_LABELS = {"a": "x", "b": "y", "c": {"d": "x"}}


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
    params, state, dtypes, traces = _traced_steps(tx, params, 3)
    adam = adam_of(state)
    unmasked = ["a", "d"] if not flat else ["a"]
    moments = [m["a"] for m in (adam.mu, adam.nu)]
    if not flat:
        moments += [m["c"]["d"] for m in (adam.mu, adam.nu)]
    assert [x.dtype for x in moments] == [np.dtype(jnp.bfloat16)] * 2 * len(unmasked)
    assert isinstance(adam.mu["b"], optax.MaskedNode)
    assert dtypes[1:] == dtypes[:1] * 3 and traces == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, {"mu": jnp.bfloat16}])
def test_flattened_statistics_are_cast(dtype):
    """optax.flatten keeps Adam's moments as one vector of the params' total size: they
    are per-parameter statistics (they stayed float32, silently; a per-field dtype
    raised "Valid choices: ." with no field in it)."""
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = jaxamp.with_state_dtype(optax.flatten(optax.adam(1e-2)), dtype)
    params, state, dtypes, traces = _traced_steps(tx, params, 3)
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


@pytest.mark.parametrize("params", [jnp.float32(1.0), jnp.ones(1)], ids=["scalar", "one"])
def test_scalar_params_never_cast_hyperparameters(params):
    """With one scalar param every scalar state leaf has the param's shape and
    structure: inject_hyperparams' hyperparameters, schedule-free's b1/weight_sum/max_lr
    and reduce_on_plateau's scale are still never cast (b2 = 0.999 became 1.0 in
    bfloat16 and Adam's update NaN)."""
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = jaxamp.with_state_dtype(adam, jnp.bfloat16)
    state = tx.init(params)
    hyper = state.inner_state.hyperparams
    assert {x.dtype for x in jax.tree.leaves(hyper)} == {np.dtype(jnp.float32)}
    assert state.inner_state.inner_state[0].mu.dtype == jnp.bfloat16
    updates, state = jax.jit(tx.update)(jnp.full_like(params, 0.5), state, params)
    np.testing.assert_allclose(updates, jnp.full_like(params, -1e-3), rtol=1e-6)
    assert float(state.inner_state.hyperparams["b2"]) == np.float32(0.999)
    free = jaxamp.with_state_dtype(optax.contrib.schedule_free_adamw(1e-3), jnp.bfloat16)
    sf = free.init(params).inner_state
    assert {sf.b1.dtype, sf.weight_sum.dtype, sf.max_lr.dtype} == {np.dtype(jnp.float32)}
    assert sf.z.dtype == jnp.bfloat16
    plateau = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())
    chained = jaxamp.with_state_dtype(plateau, jnp.bfloat16).init(params).inner_state
    assert chained[0][0].mu.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(chained[1])} <= {np.dtype(jnp.float32)} | {
        np.dtype(jnp.int32)
    }
