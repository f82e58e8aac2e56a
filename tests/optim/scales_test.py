"""Tests for jaxamp/_src/optim/scales.py: the rules, GradScaler parity, validation."""

import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.optim import DynamicLossScale, LossScaleState, NoOpLossScale, StaticLossScale


@functools.lru_cache
def _jitted_adjust(rule):
    return jax.jit(rule.adjust)  # rules are hashable: one compile per configuration


def run(rule, finite_sequence):
    """The scale after each step, with the rule applied under jit."""
    adjust = _jitted_adjust(rule)
    state, scales = rule.init(), []
    for finite in finite_sequence:
        state = adjust(state, jnp.asarray(finite))
        scales.append(float(state.scale))
    return scales


def gradscaler_reference(
    finite_sequence, init_scale, growth_factor, backoff_factor, growth_interval
):
    """torch's _amp_update_scale_ CPU kernel (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp)."""
    scale, tracker, scales = np.float32(init_scale), 0, []
    for finite in finite_sequence:
        if not finite:
            scale = np.float32(scale * backoff_factor)
            tracker = 0
        else:
            successful = tracker + 1
            if successful == growth_interval:
                with np.errstate(over="ignore"):
                    new_scale = np.float32(scale * growth_factor)
                if np.isfinite(new_scale):
                    scale = new_scale
                tracker = 0
            else:
                tracker = successful
        scales.append(float(scale))
    return scales


SEQUENCE = list(np.random.default_rng(0).random(300) > 0.15)


@pytest.mark.parametrize("growth_interval", [1, 3, 2000])
def test_defaults_follow_gradscaler_reference(growth_interval):
    rule = DynamicLossScale(growth_interval=growth_interval)
    expected = gradscaler_reference(SEQUENCE, 2.0**16, 2.0, 0.5, growth_interval)
    assert run(rule, SEQUENCE) == expected


def test_equals_torch_gradscaler():
    torch = pytest.importorskip("torch")
    sequence = SEQUENCE[:120]
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.0)
    torch_scales = []
    for finite in sequence:
        optimizer.zero_grad()
        loss = (param * (1.0 if finite else float("inf"))).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        torch_scales.append(scaler.get_scale())
    assert run(DynamicLossScale(growth_interval=3), sequence) == torch_scales
    defaults = torch.amp.GradScaler("cpu")
    rule = DynamicLossScale()
    assert (rule.init_scale, rule.growth_factor, rule.backoff_factor, rule.growth_interval) == (
        defaults.get_scale(),
        defaults.get_growth_factor(),
        defaults.get_backoff_factor(),
        defaults.get_growth_interval(),
    )


def test_growth_after_interval_and_backoff():
    rule = DynamicLossScale(init_scale=4.0, growth_interval=2)
    assert run(rule, [True, True, True, True, False, True]) == [4, 8, 8, 16, 8, 8]


def test_growth_stops_before_float32_overflow():
    rule = DynamicLossScale(init_scale=2.0**127, growth_interval=1)
    assert run(rule, [True, True]) == [2.0**127, 2.0**127]


def test_min_and_max_scale():
    rule = DynamicLossScale(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
    assert run(rule, [False, False, False, True, True, True, True]) == [2, 2, 2, 4, 8, 16, 16]


def test_hysteresis_tolerates_overflows_until_growth():
    rule = DynamicLossScale(init_scale=64.0, growth_interval=3, hysteresis=2)
    # first overflow tolerated, second backs off, third backs off again (no growth between)
    assert run(rule, [False, False, False]) == [64, 32, 16]
    # a growth restores the tolerance
    assert run(rule, [False, True, True, True, False, False]) == [64, 64, 64, 128, 128, 64]


def test_hysteresis_one_is_gradscaler():
    rule = DynamicLossScale(growth_interval=3, hysteresis=1)
    assert run(rule, SEQUENCE) == gradscaler_reference(SEQUENCE, 2.0**16, 2.0, 0.5, 3)


def test_static_and_noop_never_move():
    assert run(StaticLossScale(512.0), [False, True, False]) == [512.0] * 3
    assert run(NoOpLossScale(), [False, True]) == [1.0, 1.0]


@pytest.mark.parametrize("rule", [NoOpLossScale(), StaticLossScale(8.0), DynamicLossScale()])
def test_state_is_arrays_with_stable_dtypes(rule):
    state = rule.init()
    assert isinstance(state, LossScaleState)
    assert [x.dtype for x in state] == [jnp.float32, jnp.int32, jnp.int32]
    new = jax.jit(rule.adjust)(state, jnp.asarray(False))
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert [x.dtype for x in new] == [x.dtype for x in state]


def test_settings_hold_after_the_state_round_trips_through_jit_and_flatten():
    """The rule is static config, never a pytree leaf: after the state goes through
    flatten/unflatten and a jitted, lowered-and-compiled step, min_scale, max_scale and
    hysteresis still hold (jmp 0.0.4's DynamicLossScale drops min_loss_scale there)."""
    rule = DynamicLossScale(
        init_scale=8.0, min_scale=2.0, max_scale=16.0, hysteresis=2, growth_interval=1
    )
    assert dataclasses.is_dataclass(rule) and jax.tree.leaves(rule) == [rule]
    state = rule.init()
    compiled = jax.jit(rule.adjust).lower(state, jnp.asarray(True)).compile()
    scales = []
    for finite in [False] * 8 + [True] * 4:
        leaves, treedef = jax.tree.flatten(state)
        state = compiled(jax.tree.unflatten(treedef, leaves), jnp.asarray(finite))
        scales.append(float(state.scale))
    # hysteresis 2: the first overflow is tolerated, then halve to the floor of 2;
    # then growth every step up to the ceiling of 16
    assert scales == [8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 4.0, 8.0, 16.0, 16.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": 0.0}, "init_scale must be a positive, finite float32 number.*got 0.0"),
        ({"init_scale": float("inf")}, "init_scale must be a positive, finite float32.*got inf"),
        # outside float32's normal range: the state would hold inf or 0, for good
        ({"init_scale": 1e39}, r"init_scale must be .* to ~3\.4e38, got 1e\+39"),
        ({"init_scale": 1e-39}, r"from 2\*\*-126 .* got 1e-39"),
        ({"min_scale": 1e-50, "init_scale": 1.0}, r"min_scale must be .* got 1e-50"),
        ({"init_scale": -1.0}, "got -1.0"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1, got 1.0"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\), got 1.0"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\), got 0.0"),
        ({"growth_interval": 0}, "growth_interval must be an integer >= 1, got 0"),
        ({"growth_interval": 1.5}, "growth_interval must be an integer >= 1, got 1.5"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1, got 0"),
        ({"min_scale": -2.0}, "min_scale must be a positive, finite float32 number.*got -2.0"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "must not exceed max_scale"),
        ({"max_scale": 1024.0}, r"init_scale \(65536.0\) must lie within"),
    ],
)
def test_invalid_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScale(**kwargs)


def test_invalid_static_scale():
    with pytest.raises(ValueError, match="got nan"):
        StaticLossScale(float("nan"))


def test_configurations_are_hashable():
    assert hash(DynamicLossScale()) == hash(DynamicLossScale())
    assert hash(StaticLossScale(2.0)) != hash(StaticLossScale(4.0))


@pytest.mark.parametrize(
    "make",
    [np.float32, np.float64, jnp.float32, float, np.asarray, lambda v: np.full([], v, np.float32)],
    ids=["np.float32", "np.float64", "jnp.float32", "float", "np.asarray", "0-d float32 array"],
)
def test_numpy_and_jax_scalars_are_accepted(make):
    rule = DynamicLossScale(
        init_scale=make(1024.0), growth_factor=make(2.0), growth_interval=np.int64(10)
    )
    assert rule == DynamicLossScale(init_scale=1024.0, growth_interval=10)
    assert type(rule.init_scale) is float and type(rule.growth_interval) is int
    assert hash(rule) == hash(DynamicLossScale(init_scale=1024.0, growth_interval=10))
    assert float(rule.init().scale) == 1024.0
    assert StaticLossScale(make(8.0)).scale == 8.0


def test_jmps_default_floor_is_accepted_as_min_scale():
    rule = DynamicLossScale(init_scale=np.asarray(2.0**15), min_scale=np.ones([], np.float32))
    assert rule.min_scale == 1.0 and type(rule.min_scale) is float
    assert StaticLossScale(np.asarray(10.0)).scale == 10.0
    with pytest.raises(TypeError, match="must be a real scalar"):
        StaticLossScale(np.ones(2))


def test_adjust_takes_one_finiteness_flag():
    rule = DynamicLossScale(init_scale=8.0)
    with pytest.raises(ValueError, match=r"grads_finite must be a boolean scalar.*shape \(2,\)"):
        jax.jit(rule.adjust)(rule.init(), jnp.array([True, False]))


def test_a_non_number_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="init_scale must be a real number, got 'big'"):
        DynamicLossScale(init_scale="big")
    with pytest.raises(TypeError, match="got True"):
        DynamicLossScale(init_scale=True)


def _torch_scales(torch, sequence, init_scale, growth_interval):
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scales = []
    for finite in sequence:
        optimizer.zero_grad()
        scaler.scale((param * (1.0 if finite else float("inf"))).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    sequence=st.lists(st.booleans(), min_size=1, max_size=40),
    init_scale=st.sampled_from([1.0, 2.0**16, 2.0**126]),  # 2**126: growth stops below inf
    growth_interval=st.integers(1, 4),
)
def test_trajectory_equals_torch_gradscaler_on_any_sequence(sequence, init_scale, growth_interval):
    torch = pytest.importorskip("torch")
    rule = DynamicLossScale(init_scale=init_scale, growth_interval=growth_interval)
    assert run(rule, sequence) == _torch_scales(torch, sequence, init_scale, growth_interval)


def test_long_overflow_runs_stop_at_the_smallest_normal_scale_and_grow_back():
    """GradScaler halves through the subnormals; XLA:CPU flushes them to 0, and a scale of
    0 never grew back (after 143 overflows from 2**16). jaxamp stops at 2**-126."""
    rule = DynamicLossScale(growth_interval=1)
    scales = run(rule, [False] * 200 + [True, True])
    tiny = float(jnp.finfo(jnp.float32).tiny)
    assert scales[141] == 2.0**-126 == tiny  # GradScaler's reference, up to here
    assert scales[141:200] == [tiny] * 59
    assert scales[200:] == [2 * tiny, 4 * tiny]
    reference = gradscaler_reference([False] * 142, 2.0**16, 2.0, 0.5, 1)
    assert scales[:142] == reference
