"""Constants too large for float16 under a policy keep the value the program wrote.

Reference: the model alone in float32. A policy's layers run in float16 as traced, so
JAX rounds a Python scalar added to their outputs to float16 (``1e5`` becomes ``inf``);
the policy must evaluate it with the written value, as ``autocast`` does.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp._src.autocast import constants
from tests.helpers.expected_warnings import FLOAT16_OVERFLOW, NNX_SOW_OUTSIDE_CAPTURE
from tests.helpers.promotion import SUBJECT

# The constants under test are those float16 cannot hold: JAX's cast of one in a 16-bit
# trace warns (numpy's overflow), and what is asserted is that its value is kept.
pytestmark = FLOAT16_OVERFLOW

IDIOMS = ("shift", "mask_mul", "where_inf", "where_fill", "where_scaled", "masked_output")


def _body(s, constant, idiom):
    """Idioms of attention and masking code on the scores ``s``."""
    keep = (jnp.arange(s.shape[-1]) % 3 != 0).astype(s.dtype)
    if idiom == "shift":  # softmax is shift-invariant: a large shift is a no-op in float32
        return jax.nn.softmax(s + constant)
    if idiom == "mask_mul":  # the additive mask written as a product: 0 * -1e9 is 0
        return jax.nn.softmax(s + (1.0 - keep) * -constant)
    if idiom == "where_fill":  # a fill value, then the masked log-probabilities zeroed
        return jax.nn.log_softmax(jnp.where(keep > 0, s, -constant)) * keep
    if idiom == "where_scaled":
        return jnp.where(keep > 0, s, -constant) / constant
    if idiom == "masked_output":  # the model's output carries the constant
        return s + (1.0 - keep) * -constant
    return jax.nn.softmax(jnp.where(keep > 0, s, -jnp.inf))  # an inf written on purpose


class LinenNet(nn.Module):
    constant: float
    idiom: str

    @nn.compact
    def __call__(self, x):
        return _body(nn.Dense(12)(x), self.constant, self.idiom)


class NNXNet(nnx.Module):
    def __init__(self, constant, idiom):
        self.dense = nnx.Linear(4, 12, rngs=nnx.Rngs(0))
        self.constant, self.idiom = constant, idiom

    def __call__(self, x):
        return _body(self.dense(x), self.constant, self.idiom)


def _linen(constant, idiom, policy, x):
    model = LinenNet(constant, idiom)
    variables = model.init(jax.random.key(0), x)
    mixed = jaxamp.linen.apply_policy(model, policy)
    return jax.jit(model.apply)(variables, x), jax.jit(mixed.apply)(variables, x)


def _nnx(constant, idiom, policy, x):
    model = NNXNet(constant, idiom)
    reference = nnx.jit(lambda m, x: m(x))(model, x)
    jaxamp.nnx.apply_policy(model, policy)
    return reference, nnx.jit(lambda m, x: m(x))(model, x)


@settings(max_examples=24, deadline=None)
@given(
    constant=st.floats(65520.0, 1e37),
    idiom=st.sampled_from(IDIOMS),
    api=st.sampled_from(["linen", "nnx"]),
    policy=st.sampled_from(["mixed_float16", "mixed_bfloat16"]),
)
@example(constant=1e5, idiom="shift", api="linen", policy="mixed_float16")
@example(constant=1e9, idiom="mask_mul", api="nnx", policy="mixed_float16")
@example(constant=1e9, idiom="where_fill", api="linen", policy="mixed_float16")
@example(constant=7e4, idiom="where_scaled", api="nnx", policy="mixed_float16")
@example(constant=1e9, idiom="masked_output", api="linen", policy="mixed_float16")
def test_a_constant_float16_cannot_hold_keeps_its_value(constant, idiom, api, policy):
    x = jax.random.normal(jax.random.key(1), (3, 4))
    reference, out = (_linen if api == "linen" else _nnx)(constant, idiom, policy, x)
    assert bool(jnp.all(jnp.isfinite(reference)))
    assert bool(jnp.all(jnp.isfinite(out))), out
    # The layer's output within its 16-bit rounding (atol). The constant: bfloat16 holds
    # it, rounded (rtol: its eps); float16 cannot, and keeps float32's value (rtol 1e-6).
    rtol = float(jnp.finfo(jnp.bfloat16).eps) if policy == "mixed_bfloat16" else 1e-6
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, rtol=rtol, atol=2e-2)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_gradients_through_the_mask_idiom_stay_finite(api):
    x = jax.random.normal(jax.random.key(1), (3, 4))
    if api == "linen":
        model = jaxamp.linen.apply_policy(LinenNet(1e9, "mask_mul"), "mixed_float16")
        params = model.init(jax.random.key(0), x)["params"]
        grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, x)[:, 1].sum()))(params)
    else:
        model = jaxamp.nnx.apply_policy(NNXNet(1e9, "mask_mul"), "mixed_float16")
        grads = nnx.jit(nnx.grad(lambda m: m(x)[:, 1].sum()))(model)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(bool(jnp.any(g != 0)) for g in leaves)


def _two_traces(fn16, fn32, x):
    return (
        jax.make_jaxpr(fn16)(x.astype(jnp.float16)).jaxpr,
        jax.make_jaxpr(fn32)(x).jaxpr,
    )


def test_a_written_inf_is_left_as_written():
    fn = lambda x: x + jnp.inf
    traced, wide = _two_traces(fn, fn, jnp.ones(3))
    assert constants.rounded_to_inf(traced)
    assert constants.written_values(traced, wide) == {}


@pytest.mark.parametrize(
    "fn, rounded",
    [
        (jax.nn.softmax, False),  # initial=-inf, written by JAX
        (jax.nn.log_softmax, False),
        (jax.nn.logsumexp, False),
        (lambda x: jnp.max(x, initial=-1e5), True),  # the caller's initial, rounded
        (lambda x: jnp.maximum(x, -1e5), True),
        (lambda x: jax.nn.softmax(x + 1e5), True),
        (lambda x: jax.nn.softmax(x * -1e9), True),
    ],
)
def test_only_the_identities_jax_writes_are_exempt(fn, rounded):
    """The -inf that JAX's own softmax and logsumexp reduce with is the same in every
    trace; any other non-finite 16-bit constant may have been rounded, and is looked up."""
    with np.errstate(over="ignore"):
        traced = jax.make_jaxpr(fn)(jnp.ones((2, 3), jnp.float16)).jaxpr
    assert constants.rounded_to_inf(traced) == rounded


class _Scores(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jax.nn.log_softmax(nn.Dense(8)(x)), jax.nn.logsumexp(nn.Dense(8)(x), -1)


def test_softmax_under_a_policy_is_traced_once(monkeypatch):
    """A layer's softmax in float16 (its -inf identity) needs no float32 trace to find
    written values: the policy traces the model once."""
    traces = []
    make_jaxpr = jax.make_jaxpr

    def counting(fun, *args, **kwargs):
        traces.append(fun)
        return make_jaxpr(fun, *args, **kwargs)

    x = jnp.linspace(-2, 2, 24).reshape(3, 8)
    model = jaxamp.linen.apply_policy(_Scores(), "mixed_float16")
    variables = model.init(jax.random.key(0), x)
    monkeypatch.setattr(jax, "make_jaxpr", counting)
    out = jax.jit(model.apply)(variables, x)
    assert len(traces) == 1
    expected = _Scores().apply(variables, x)
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=3e-2)


def test_a_constant_with_two_values_at_one_place_is_left_as_traced():
    """One source line that adds 1e5 in one trace and 1e6 in the other: no value is
    guessed."""
    traced, _ = _two_traces(lambda x: x + 1e5, lambda x: x, jnp.ones(3))
    wide = jax.make_jaxpr(lambda x: [x + c for c in (1e5, 1e6)])(jnp.ones(3)).jaxpr
    assert constants.written_values(traced, wide) == {}


def test_the_written_value_is_found_at_its_line():
    fn = lambda x: x + 1e5
    traced, wide = _two_traces(fn, fn, jnp.ones(3))
    (value,) = constants.written_values(traced, wide).values()
    assert value.dtype == np.float32 and float(value) == 1e5


def _control_flow_case(kind, s):
    if kind == "cond":
        return jax.lax.cond(True, lambda a: a + 1e5, lambda a: a - 1e5, s)
    if kind == "fori_loop":
        return jax.lax.fori_loop(0, 2, lambda i, a: a + 1e5, s)
    if kind == "while_loop":
        return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] - 1e5), (0, s))[1]
    if kind == "scan":
        return jax.lax.scan(lambda a, _: (a + 1e5, a * 2), s, length=3)[0]
    return s + jnp.arange(s.shape[-1]) * 1e5  # an array of constants, not a literal


class _ControlFlowNet(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        return _control_flow_case(self.kind, nn.Dense(8)(x))


class _ControlFlowNNX(nnx.Module):
    def __init__(self, kind):
        self.kind = kind
        self.dense = nnx.Linear(4, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return _control_flow_case(self.kind, self.dense(x))


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("path", ["linen", "nnx"])
@pytest.mark.parametrize("kind", ["cond", "fori_loop", "while_loop", "scan", "folded_array"])
def test_a_constant_in_control_flow_or_an_array_keeps_its_value(kind, path):
    """A loop's carry or a cond's result that a written constant makes too large for
    float16 is carried in float32, as the same code outside control flow computes it; so
    is an array computed from constants alone (``jnp.arange(n) * 1e5``)."""
    x = jax.random.normal(jax.random.key(1), (3, 4))
    if path == "linen":
        model = _ControlFlowNet(kind)
        variables = model.init(jax.random.key(0), x)
        reference = jax.jit(model.apply)(variables, x)
        policed = jaxamp.linen.apply_policy(model, "mixed_float16")
        out = jax.jit(policed.apply)(variables, x)
    else:
        reference = nnx.jit(lambda m, x: m(x))(_ControlFlowNNX(kind), x)
        policed = jaxamp.nnx.apply_policy(_ControlFlowNNX(kind), "mixed_float16")
        out = nnx.jit(lambda m, x: m(x))(policed, x)
    assert bool(jnp.all(jnp.isfinite(reference)))
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, rtol=1e-3)


def test_a_loop_without_written_constants_keeps_its_traced_carry():
    """Only a body holding such a constant widens a carry: a float16 loop stays float16."""
    x = jax.random.normal(jax.random.key(1), (3, 4))

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            return jax.lax.fori_loop(0, 2, lambda i, a: jnp.exp(a) * 0.5, h)

    policed = jaxamp.linen.apply_policy(Plain(), "mixed_float16")
    variables = policed.init(jax.random.key(0), x)
    program = jax.jit(policed.apply).lower(variables, x).as_text()
    (loop,) = [line for line in program.splitlines() if "stablehlo.while" in line]
    assert loop.endswith("tensor<i32>, tensor<3x8xf16>"), loop


class _SowingNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        self.sow("intermediates", "shifted", h + 1e5)
        return h


class _SowingNNX(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(4, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.dense(x)
        self.sow(nnx.Intermediate, "shifted", h + 1e5)
        return h


@NNX_SOW_OUTSIDE_CAPTURE
@pytest.mark.parametrize("path", ["linen", "nnx"])
def test_a_sown_value_keeps_a_constant_s_value(path):
    """State a call writes (a sown intermediate) holding such a constant keeps its value:
    it comes back in float32 where its float16 type would hold ``inf``."""
    x = jax.random.normal(jax.random.key(1), (3, 4))
    if path == "linen":
        model = _SowingNet()
        variables = model.init(jax.random.key(0), x)
        policed = jaxamp.linen.apply_policy(model, "mixed_float16")
        sown = [
            jax.jit(lambda v, x, m=m: m.apply(v, x, mutable=["intermediates"]))(variables, x)[1]
            for m in (model, policed)
        ]
        reference, out = (s["intermediates"]["shifted"][0] for s in sown)
    else:
        sown = []
        for module in (_SowingNNX(), jaxamp.nnx.apply_policy(_SowingNNX(), "mixed_float16")):
            nnx.jit(lambda m, x: m(x))(module, x)
            sown.append(module.shifted.get_value()[0])
        reference, out = sown
    assert bool(jnp.all(jnp.isfinite(reference)))
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, rtol=1e-3)


# ---- from the hostile review: constants the first pass of this work missed ----------------


def _policy_pair(linen_module, nnx_factory, path, *inputs):
    """``(reference, out)``: the model alone in float32 and under mixed_float16."""
    if path == "linen":
        variables = linen_module.init(jax.random.key(0), *inputs)
        reference = jax.jit(linen_module.apply)(variables, *inputs)
        policed = jaxamp.linen.apply_policy(linen_module, "mixed_float16")
        return reference, jax.jit(policed.apply)(variables, *inputs)
    reference = nnx.jit(lambda m, *a: m(*a))(nnx_factory(), *inputs)
    policed = jaxamp.nnx.apply_policy(nnx_factory(), "mixed_float16")
    return reference, nnx.jit(lambda m, *a: m(*a))(policed, *inputs)


class _TwoShifts(nn.Module):
    """One line adds two different constants (a layer used twice, a Python loop)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4)(x)
        for c in (1e5, 3e5):
            h = h + c
        return h - 4e5


class _TwoShiftsNNX(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.dense(x)
        for c in (1e5, 3e5):
            h = h + c
        return h - 4e5


class _MaskBias(nn.Module):
    """The additive mask bias: ``jnp.where(mask, 0.0, -1e9)``, a fully masked row."""

    @nn.compact
    def __call__(self, x, mask):
        return jax.nn.softmax(nn.Dense(3)(x) + jnp.where(mask, 0.0, -1e9))


class _MaskBiasNNX(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x, mask):
        return jax.nn.softmax(self.dense(x) + jnp.where(mask, 0.0, -1e9))


_CAPTURED = jnp.arange(4.0) * 1e5  # made outside the model: a constant of its program


class _Captured(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x) + _CAPTURED - _CAPTURED


class _CapturedNNX(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x) + _CAPTURED - _CAPTURED


class _ScatterFill(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x).at[:, 0].set(-1e9)


class _ScatterFillNNX(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x).at[:, 0].set(-1e9)


_MASK = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], bool)
_REVIEW_CASES = {
    "same line, two values": (_TwoShifts(), _TwoShiftsNNX, ()),
    "where(mask, 0, -1e9) bias": (_MaskBias(), _MaskBiasNNX, (_MASK,)),
    "captured array": (_Captured(), _CapturedNNX, ()),
    "scatter fill": (_ScatterFill(), _ScatterFillNNX, ()),
}


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("path", ["linen", "nnx"])
@pytest.mark.parametrize("case", _REVIEW_CASES)
def test_constants_the_review_found_keep_their_value(case, path):
    """Each was NaN, inf or wrong under mixed_float16: one place holding two constants,
    a mask bias selected from two Python scalars (a fully masked row), an array made
    outside the model, and ``.at[...].set(-1e9)``."""
    module, factory, extra = _REVIEW_CASES[case]
    x = jax.random.normal(jax.random.key(1), (3, 3)) * 0.1
    reference, out = _policy_pair(module, factory, path, x, *extra)
    assert bool(jnp.all(jnp.isfinite(reference)))
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, rtol=1e-3, atol=1e-3)


def test_a_mask_bias_inside_a_loop_widens_the_carry():
    x = jax.random.normal(jax.random.key(1), (3, 3)) * 0.1

    class Loop(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            s = nn.Dense(3)(x)
            body = lambda i, a: a + jnp.where(mask, 0.0, -1e9) - jnp.where(mask, 0.0, -1e9)
            return jax.lax.fori_loop(0, 2, body, s)

    reference, out = _policy_pair(Loop(), None, "linen", x, _MASK)
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, rtol=1e-3, atol=1e-3)


@settings(max_examples=12, deadline=None)
@given(
    fill=st.sampled_from([-1e9, float(np.finfo(np.float32).min), -1e5, -7e4]),
    masked_rows=st.integers(1, 3),
    policy=st.sampled_from(["mixed_float16", "mixed_bfloat16"]),
    simplified=st.booleans(),
)
@example(fill=-1e9, masked_rows=1, policy="mixed_float16", simplified=True)
def test_a_closed_over_mask_bias_keeps_its_value_under_simplified_constants(
    fill, masked_rows, policy, simplified
):
    """Under ``jax_use_simplified_jaxpr_constants`` (a temporary flag: JAX will flip it)
    an array the function closes over is written inline as a literal, not as a constant
    argument. A float32 mask bias must keep its value as it does without the flag: a
    fully masked row gives the uniform distribution float32 gives, not NaN."""
    if not hasattr(jax.config, "jax_use_simplified_jaxpr_constants"):
        pytest.skip("this jax has no jax_use_simplified_jaxpr_constants")
    mask = np.arange(4)[None, :] < np.arange(1, 5)[:, None] - masked_rows
    bias = jnp.asarray(np.where(mask, 0.0, fill), jnp.float32)

    def f(x, w):
        return jax.nn.softmax(x @ w + bias)

    x = jnp.linspace(-1, 1, 16).reshape(4, 4)
    w = jnp.eye(4)
    previous = jax.config.jax_use_simplified_jaxpr_constants
    jax.config.update("jax_use_simplified_jaxpr_constants", simplified)
    try:
        got = jax.jit(jaxamp.autocast(f, policy))(x, w)
    finally:
        jax.config.update("jax_use_simplified_jaxpr_constants", previous)
    np.testing.assert_allclose(got, f(x, w), atol=1e-2)


@NNX_SOW_OUTSIDE_CAPTURE
@pytest.mark.parametrize("path", ["linen", "nnx", "autocast"])
def test_a_constant_is_kept_wide_under_a_users_strict_promotion(path):
    """Keeping a constant wide is the rules' own promotion (float16 with float32 is
    float32), made whatever the user's ``jax_numpy_dtype_promotion``: under "strict" it
    raised TypePromotionError from inside the policy."""
    x = jax.random.normal(jax.random.key(1), (3, 4))
    with jax.numpy_dtype_promotion("strict"):
        if path == "linen":
            model = _SowingNet()
            variables = model.init(jax.random.key(0), x)
            policed = jaxamp.linen.apply_policy(model, "mixed_float16")
            _, state = jax.jit(lambda v, x: policed.apply(v, x, mutable=["intermediates"]))(
                variables, x
            )
            out = state["intermediates"]["shifted"][0]
        elif path == "nnx":
            module = jaxamp.nnx.apply_policy(_SowingNNX(), "mixed_float16")
            nnx.jit(lambda m, x: m(x))(module, x)
            out = module.shifted.get_value()[0]
        else:
            w = jax.random.normal(jax.random.key(0), (4, 8))
            out = jax.jit(jaxamp.autocast(lambda w, x: x @ w + 1e5, "mixed_float16"))(w, x)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.max(jnp.abs(np.asarray(out, np.float32) - 1e5))) < 100


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_autocast_outputs_keep_their_traced_dtype_where_a_constant_was_kept_wide(policy):
    """A function traced on float16 inputs with a -1e9 mask returns float16 under autocast,
    as it does alone (an output kept wider than traced is the policies' sown state): it
    came back float32, silently, and a scan carrying it refused the carry."""
    x = jnp.array([1.0, -2.0, 3.0, -0.5], jnp.float16)
    f = lambda x: jax.nn.softmax(jnp.where(x > 0, x, -1e9))
    g = jaxamp.autocast(f, policy)
    assert g(x).dtype == f(x).dtype == jnp.float16
    np.testing.assert_allclose(
        np.asarray(g(x), np.float32), np.asarray(f(x), np.float32), atol=2e-3
    )
    carried, _ = jax.lax.scan(lambda c, _: (g(c), None), x, length=2)
    alone, _ = jax.lax.scan(lambda c, _: (f(c), None), x, length=2)
    assert carried.dtype == jnp.float16
    np.testing.assert_allclose(
        np.asarray(carried, np.float32), np.asarray(alone, np.float32), atol=2e-3
    )
    masked = jaxamp.autocast(lambda x: jnp.where(x > 0, x, -1e9), policy)(x)
    assert masked.dtype == jnp.float16 and bool(jnp.all(jnp.isneginf(masked[x < 0])))
