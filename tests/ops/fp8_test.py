"""The float8 matmul rule against references: a numpy quantize/dequantize for current scaling,
Flax's ``fp8_ops`` for delayed scaling; the state's max-combination; edge values."""

import functools
import re

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.linen import fp8_ops

import jaxamp
from jaxamp.ops import Fp8State, fp8_dot_general, init_gemm_fp8_state, max_combined
from tests.helpers.expected_warnings import FLOAT16_OVERFLOW

DN = (((1,), (0,)), ((), ()))
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _np_scale(amax, fmax, margin=0):
    if not amax > 0:
        return np.float32(1)
    with np.errstate(over="ignore"):  # a subnormal amax: fmax / amax is inf, the scale 0
        return np.float32(1.0) / ((np.float32(fmax) / np.float32(amax)) / np.float32(2.0**margin))


def _np_qdq(x, dtype, fmax, margin=0):
    """Quantize to float8 and back, in numpy (ml_dtypes), with a per-tensor amax scale."""
    x = np.asarray(x, np.float32)
    scale = _np_scale(np.max(np.abs(x)) if x.size else 0, fmax, margin)
    with np.errstate(divide="ignore", invalid="ignore"):  # a scale of 0 (_np_scale): x / 0
        q = np.clip(x / scale, -fmax, fmax).astype(dtype)
    return q.astype(np.float32), scale


def _np_gemms(lhs, rhs, g, dn, margin=0):
    """The three float8 GEMMs of current scaling for ``lax.dot_general``'s dimension
    numbers ``dn``, in numpy: ``(y, d_lhs, d_rhs)``, each with the bound float32 sums
    allow. The products of two float8 values (4 and 3 significant bits at most) are exact
    in float32, so the only roundings are the float32 sums of ``k`` products, at most
    ``(k - 1) * 2**-24`` of the sum of their magnitudes, and two of the dequantization
    (the scales' product, the result times it): ``(k + 1) * 2**-24`` of the magnitudes."""
    (ql, sl), (qr, sr) = (_np_qdq(v, ml_dtypes.float8_e4m3fn, E4M3_MAX, margin) for v in (lhs, rhs))
    qg, sg = _np_qdq(g, ml_dtypes.float8_e5m2, E5M2_MAX, margin)
    (l_contract, r_contract), (l_batch, r_batch) = dn
    names = iter("abcdefghijklmnopqrstuvwxyz")
    l_sub, r_sub = [""] * ql.ndim, [""] * qr.ndim
    for i, j in [*zip(l_batch, r_batch, strict=True), *zip(l_contract, r_contract, strict=True)]:
        l_sub[i] = r_sub[j] = next(names)
    l_sub = [c or next(names) for c in l_sub]
    r_sub = [c or next(names) for c in r_sub]
    free = lambda sub, used: [c for i, c in enumerate(sub) if i not in used]
    out_sub = [l_sub[i] for i in l_batch]
    out_sub += free(l_sub, (*l_contract, *l_batch)) + free(r_sub, (*r_contract, *r_batch))
    l_sub, r_sub, out_sub = ("".join(v) for v in (l_sub, r_sub, out_sub))
    k = int(np.prod([ql.shape[i] for i in l_contract]))
    k_l = int(np.prod([qr.shape[i] for i in range(qr.ndim) if i not in (*r_contract, *r_batch)]))
    k_r = int(np.prod([ql.shape[i] for i in range(ql.ndim) if i not in (*l_contract, *l_batch)]))

    def gemm(spec, a, b, scale, terms):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        value = np.einsum(spec, a, b) * np.float64(scale)
        bound = np.einsum(spec, np.abs(a), np.abs(b)) * abs(np.float64(scale))
        return value, (terms + 1) * 2.0**-24 * bound

    return (
        gemm(f"{l_sub},{r_sub}->{out_sub}", ql, qr, np.float32(sl * sr), k),
        gemm(f"{out_sub},{r_sub}->{l_sub}", qg, qr, np.float32(sr * sg), k_l),
        gemm(f"{out_sub},{l_sub}->{r_sub}", qg, ql, np.float32(sl * sg), k_r),
    )


def _assert_within(got, want_and_bound, what):
    want, bound = want_and_bound
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, what
    excess = np.abs(got - want) - bound
    assert np.all(excess <= 0), f"{what}: {np.sum(excess > 0)} beyond float32 sums, {excess.max()}"


def _arrays(shape):
    finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
    return st.lists(finite, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))).map(
        lambda v: np.asarray(v, np.float32).reshape(shape)
    )


def _cancelling_example():
    """Two large products of a weight gradient's element that cancel to the float8 value of
    a third, small one: float32 sums lose it or keep it by their order (Flax's and
    jaxamp's: 0.71, where float64 gives 1.0), as the rounding of float32 sums allows."""
    lhs, rhs, g = np.zeros((4, 16), np.float32), np.zeros((16, 8), np.float32), np.zeros((4, 8))
    lhs[:, 6] = [7744.0, 1.0, 0.0, -4006.0]
    g[:, 5] = [1092.0, 1.0, 0.0, 2351.0]
    return lhs, rhs, g.astype(np.float32)


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(
    st.sampled_from([(1, 1, 1), (3, 5, 2), (4, 16, 8)]).flatmap(
        lambda s: st.tuples(_arrays((s[0], s[1])), _arrays((s[1], s[2])), _arrays((s[0], s[2])))
    ),
    st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
)
# the bound's ends rounded to float16 may overflow to inf, as the gradient does
@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@FLOAT16_OVERFLOW
@hypothesis.example(_cancelling_example(), jnp.float32)
def test_current_scaling_matches_numpy_quantize_dequantize(arrays, dtype):
    """The three GEMMs against numpy's, within the rounding of float32 sums (a relative
    tolerance of 1e-5 held only by the luck of the sums' order where products cancel)."""
    lhs, rhs, g = arrays
    lhs_in = jnp.asarray(lhs, dtype)
    lhs = np.asarray(lhs_in, np.float32)  # the reference sees what the op sees

    y, dl, dr = _forward_and_gradients(lhs_in, jnp.asarray(rhs), jnp.asarray(g))
    want_y, want_l, want_r = _np_gemms(lhs, rhs, g, DN)
    assert y.dtype == jnp.float32 and dl.dtype == dtype and dr.dtype == jnp.float32
    _assert_within(y, want_y, "y")
    _assert_within(dr, want_r, "d_rhs")
    # The input's gradient comes back in the input's dtype, rounded once more (to inf where
    # float16 overflows): between the roundings of the ends of the float32 sums' range.
    value, bound = want_l
    lo, hi = (
        np.asarray(jnp.asarray(v.astype(np.float32), dtype), np.float64)
        for v in (value - bound, value + bound)
    )
    got = np.asarray(dl, np.float64)
    assert np.all((lo <= got) & (got <= hi)), (got, value, bound)


@jax.jit
def _forward_and_gradients(lhs, rhs, g):
    def f(a, b):
        return fp8_dot_general(a, b, DN, preferred_element_type=jnp.float32)

    y, vjp = jax.vjp(f, lhs, rhs)
    return (y, *vjp(g))


_FLAX_LAYERS = {
    # a transformer MLP's projection: 64 tokens, 256 -> 128 features
    "dense": (lambda op: nn.Dense(128, dot_general_cls=op), (64, 256), DN),
    # two contracting axes, as DenseGeneral(axis=(-2, -1)) contracts them
    "dense_general_2_axes": (
        lambda op: nn.DenseGeneral((4, 6), axis=(-2, -1), dot_general_cls=op),
        (32, 7, 9),
        (((1, 2), (0, 1)), ((), ())),
    ),
}


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("layer", sorted(_FLAX_LAYERS))
def test_delayed_scaling_matches_flax_fp8_ops_step_for_step(layer):
    """The raw op with Flax's state, against ``Fp8DirectDotGeneralOp`` in a Dense and a
    DenseGeneral of realistic widths, over steps whose inputs grow and shrink (the scale
    follows the history): outputs, the kernel's and the input's gradients and the next
    state bit for bit."""
    make, shape, dn = _FLAX_LAYERS[layer]
    model = make(fp8_ops.Fp8DirectDotGeneralOp)
    x0 = jax.random.normal(jax.random.key(0), shape)
    variables = model.init(jax.random.key(1), x0)
    coll = fp8_ops.OVERWRITE_WITH_GRADIENT
    state = Fp8State(**variables[coll]["Fp8DirectDotGeneralOp_0"])
    params = variables["params"]

    def mine(kernel, state, x):
        y = fp8_dot_general(x, kernel, dn, preferred_element_type=jnp.float32, fp8_state=state)
        return jnp.sum((y + params["bias"]) ** 2)

    def theirs(variables, x):
        return jnp.sum(model.apply(variables, x) ** 2)

    step = jax.jit(jax.grad(mine, argnums=(0, 1, 2)))
    ref_step = jax.jit(jax.grad(theirs, argnums=(0, 1)))
    for i, factor in enumerate([1.0, 3.0, 0.5, 100.0, 1e-3]):
        x = x0 * factor
        ref, ref_dx = ref_step(variables, x)
        d_kernel, new_state, dx = step(params["kernel"], state, x)
        ref_state = ref[coll]["Fp8DirectDotGeneralOp_0"]
        for name in Fp8State._fields:
            np.testing.assert_array_equal(getattr(new_state, name), ref_state[name], err_msg=name)
        np.testing.assert_array_equal(d_kernel, ref["params"]["kernel"], err_msg=f"step {i}")
        np.testing.assert_array_equal(dx, ref_dx, err_msg=f"input gradient, step {i}")
        y_ref = model.apply(variables, x)
        y = fp8_dot_general(x, params["kernel"], dn, jnp.float32, fp8_state=state) + params["bias"]
        np.testing.assert_array_equal(y, y_ref)
        variables = {"params": params, coll: ref[coll]}
        state = new_state


def _state_grad(fn, state, *args):
    return jax.jit(jax.grad(fn))(state, *args)


def test_state_used_twice_combines_by_max_not_sum():
    """A layer called on two inputs: the new history holds the larger amax, not the sum."""
    from jaxamp._src.ops.fp8_state import max_combined

    w = jnp.ones((3, 2))
    a, b = jnp.full((2, 3), 2.0), jnp.full((2, 3), 5.0)

    def loss(state):
        state = max_combined(state)
        return jnp.sum(
            fp8_dot_general(a, w, DN, fp8_state=state) + fp8_dot_general(b, w, DN, fp8_state=state)
        )

    new = _state_grad(loss, init_gemm_fp8_state(4))
    assert float(new.input_amax_history[0]) == 5.0
    assert float(new.output_grad_amax_history[0]) == 1.0
    np.testing.assert_array_equal(new.input_scale, [1.0])


@pytest.mark.parametrize("transform", ["scan", "vmap", "remat", "fori"])
def test_state_combines_by_max_under_transformations(transform):
    from jaxamp._src.ops.fp8_state import max_combined

    w = jnp.ones((3, 2))
    xs = jnp.arange(1.0, 5.0)[:, None, None] * jnp.ones((4, 2, 3))  # amaxes 1, 2, 3, 4

    def one(state, x):
        return jnp.sum(fp8_dot_general(x, w, DN, fp8_state=state))

    def loss(state):
        state = max_combined(state)
        if transform == "scan":
            return jax.lax.scan(lambda c, x: (c + one(state, x), None), 0.0, xs)[0]
        if transform == "vmap":
            return jnp.sum(jax.vmap(one, in_axes=(None, 0))(state, xs))
        if transform == "fori":
            return jax.lax.fori_loop(0, 4, lambda i, c: c + one(state, xs[i]), 0.0)
        return sum(jax.checkpoint(one)(state, x) for x in xs)

    new = _state_grad(loss, init_gemm_fp8_state(4))
    assert float(new.input_amax_history[0]) == 4.0
    assert float(new.kernel_amax_history[0]) == 1.0


def test_plain_float32_state_is_summed_which_is_why_it_is_max_combined():
    """The reference behaviour that ``max_combined`` exists for (Flax's own float32 state)."""
    w = jnp.ones((3, 2))
    a = jnp.full((2, 3), 2.0)

    def loss(state):
        return jnp.sum(
            fp8_dot_general(a, w, DN, fp8_state=state) * 2
            + fp8_dot_general(a, w, DN, fp8_state=state)
        )

    new = _state_grad(loss, init_gemm_fp8_state(4))
    assert float(new.input_amax_history[0]) == 4.0  # 2 + 2: summed


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_operand_or_gradient_is_not_hidden_by_clipping(bad, delayed):
    """float8_e4m3fn has no infinity: clipping an overflow to 448 would give finite
    results and gradients, and loss scaling would never see the overflow."""
    state = init_gemm_fp8_state(4) if delayed else None
    x = jnp.ones((2, 3)).at[0, 1].set(bad)
    w = jnp.ones((3, 2))
    y = fp8_dot_general(x, w, DN, fp8_state=state)
    assert not np.isfinite(np.asarray(y)).any()
    g = jnp.ones((2, 2)).at[1, 1].set(bad)
    y2, vjp2 = jax.vjp(lambda w: fp8_dot_general(jnp.ones((2, 3)), w, DN, fp8_state=state), w)
    (dw,) = vjp2(g)
    assert np.isfinite(np.asarray(y2)).all() and not np.isfinite(np.asarray(dw)).any()


def test_a_non_finite_amax_is_kept_out_of_the_history():
    """An overflow step (skipped by loss scaling) must not freeze the scale for the length
    of the history, as an inf in it would: it is pushed as 0 (no information)."""
    state = init_gemm_fp8_state(4)._replace(input_amax_history=jnp.array([2.0, 0, 0, 0]))
    x = jnp.ones((2, 3)).at[0, 0].set(jnp.inf)

    def loss(state):
        return jnp.sum(fp8_dot_general(x, jnp.ones((3, 2)), DN, fp8_state=state))

    new = jax.grad(loss)(state)
    np.testing.assert_array_equal(new.input_amax_history, [0.0, 0, 0, 2.0])
    assert np.isfinite(np.asarray(new.input_scale)).all()


def test_two_uses_one_overflowing_push_the_finite_amax():
    """Max-combined uses whose second overflows: the history is the finite use's push,
    not a mix of the pushed and the unpushed one."""
    from jaxamp._src.ops.fp8_state import max_combined

    state = init_gemm_fp8_state(4)._replace(
        output_grad_amax_history=jnp.array([4.0, 3.0, 2.0, 1.0])
    )
    w = jnp.ones((3, 2))

    def loss(state, bad):
        state = max_combined(state)
        a = fp8_dot_general(jnp.ones((2, 3)), w, DN, fp8_state=state)
        b = fp8_dot_general(jnp.ones((2, 3)), w, DN, fp8_state=state)
        return jnp.sum(a) + jnp.sum(b) * bad

    new = jax.grad(loss)(state, jnp.float32(jnp.inf))
    np.testing.assert_array_equal(new.output_grad_amax_history, [1.0, 2.0, 1.0, 4.0])


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_an_inf_operand_reaches_the_other_operands_gradient(bad):
    """The weight's gradient of a layer whose input holds inf or NaN is NaN, every element
    (the saved input, clipped to 448, must not make any of it look finite), and the
    input's own gradient is the float8 GEMM of the output gradient and the weight, as the
    numpy emulation computes it (it was only checked to be not all finite)."""
    x = jax.random.normal(jax.random.key(0), (4, 8)).at[1, 2].set(bad)
    w = jax.random.normal(jax.random.key(1), (8, 3))
    g = jax.random.normal(jax.random.key(2), (4, 3))
    for state in (None, init_gemm_fp8_state(4)):
        _, vjp = jax.vjp(lambda x, w, m=state: fp8_dot_general(x, w, DN, fp8_state=m), x, w)
        dx, dw = vjp(g)
        assert np.isnan(np.asarray(dw)).all(), state is None
        if state is None:  # current scaling: the emulation's scales
            _, want, _ = _np_gemms(np.zeros_like(x), w, g, DN)
        else:  # a fresh state: scales of 1
            qg = np.asarray(g).astype(ml_dtypes.float8_e5m2).astype(np.float64)
            qw = np.asarray(w).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            want = (qg @ qw.T, 4 * 2.0**-24 * (np.abs(qg) @ np.abs(qw.T)))
        _assert_within(dx, want, "dx")


@pytest.mark.parametrize("value", [0.0, 1e-40, 1e-30, 3e37])
def test_edge_amax_zero_subnormal_and_large(value):
    """amax of zero keeps the previous scale (no division by zero); a subnormal amax, whose
    scale would not be a normal float32, keeps it too (the values flush to zero, as float8
    cannot hold them); large values are scaled into range by current scaling."""
    x = jnp.full((2, 3), value, jnp.float32)
    w = jnp.ones((3, 2))
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for state in (None, init_gemm_fp8_state(4)):
        y = fp8_dot_general(x, w, DN, fp8_state=state)
        assert np.isfinite(np.asarray(y)).all(), (value, state is None)
        if state is None or value == 0.0:  # a fresh history's scale is 1: values clip or flush
            np.testing.assert_allclose(y, expected, rtol=0.07, atol=1e-39)


def test_a_product_beyond_float32_is_inf_as_in_float32():
    x = jnp.full((2, 3), 3.4e38, jnp.float32)
    y = fp8_dot_general(x, jnp.ones((3, 2)), DN)
    assert np.isinf(np.asarray(y)).all()


def test_e4m3_saturates_under_delayed_scaling_when_amax_grows():
    """Delayed scaling quantizes with the history's amax: a step whose amax grows past it
    clips to 448 * scale (documented); the next step's scale covers it."""
    state = init_gemm_fp8_state(4)._replace(
        input_amax_history=jnp.array([1.0, 0, 0, 0]), input_scale=jnp.array([1.0 / 448])
    )
    x = jnp.full((1, 1), 10.0)
    y = fp8_dot_general(x, jnp.ones((1, 1)), DN, fp8_state=state)
    np.testing.assert_allclose(y, [[1.0]])  # clipped at the old amax
    new = jax.grad(lambda m: jnp.sum(fp8_dot_general(x, jnp.ones((1, 1)), DN, fp8_state=m)))(state)
    y2 = fp8_dot_general(x, jnp.ones((1, 1)), DN, fp8_state=new)
    np.testing.assert_allclose(y2, [[10.0]], rtol=0.07)


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize(
    "shapes, dn",
    [
        # a batch dimension and non-trailing contracting dimensions, in both operands
        (((2, 5, 3), (2, 4, 5)), (((1,), (2,)), ((0,), (0,)))),
        # attention-like: batch and heads, 64 contracted, realistic widths
        (((4, 8, 32, 64), (4, 8, 64, 32)), (((3,), (2,)), ((0, 1), (0, 1)))),
        # two contracting axes in another order in each operand (DenseGeneral's weight)
        (((16, 7, 9), (9, 7, 6)), (((1, 2), (1, 0)), ((), ()))),
    ],
)
@pytest.mark.parametrize("margin", [0, 2])
def test_gemms_and_gradients_match_a_numpy_float8_emulation(shapes, dn, margin):
    """The forward GEMM and both gradients, for batch and non-trailing contracting
    dimensions and a margin, against numpy: operands rounded to e4m3 and the output
    gradient to e5m2 by ml_dtypes, each product in float64, within the rounding of
    float32 sums (the gradients were only checked within 15% of a float32 GEMM's)."""
    keys = jax.random.split(jax.random.key(0), 5)

    def spread(key, shape):  # magnitudes over four decades: float8's subnormals are used
        return 10.0 ** jax.random.uniform(key, shape, minval=-4.0, maxval=0.0)

    lhs = jax.random.normal(keys[0], shapes[0]) * 3.0 * spread(keys[3], shapes[0])
    rhs = jax.random.normal(keys[1], shapes[1]) * 0.05
    y_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), lhs, rhs).shape
    g = jax.random.normal(keys[2], y_shape) * 1e-3 * spread(keys[4], y_shape)

    @jax.jit
    def run(a, b, g):
        y, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, dn, margin=margin), a, b)
        return (y, *vjp(g))

    y, d_lhs, d_rhs = run(lhs, rhs, g)
    want_y, want_l, want_r = _np_gemms(lhs, rhs, g, dn, margin)
    _assert_within(y, want_y, "y")
    _assert_within(d_lhs, want_l, "d_lhs")
    _assert_within(d_rhs, want_r, "d_rhs")
    # the emulation is no float32 GEMM: its float8 roundings are a few percent
    exact = jax.lax.dot_general(lhs, rhs, dn, precision="highest")
    assert np.max(np.abs(want_y[0] - np.asarray(exact))) > 1e3 * np.max(want_y[1])


@pytest.mark.parametrize("margin", [-1, 0.5, True, "1", None, 15, 19, 128, 2**40])
def test_a_margin_the_recipe_refuses_is_refused_by_fp8_dot_general_too(margin):
    """``margin=-1`` clipped every operand above half its amax, and ``0.5`` ran as a
    fractional headroom; beyond 14 the scaled operands flush toward zero (margin 16 made
    a product of 1.5 into 1.10, 19 into 0, 128 into NaN). One check for both, naming
    the value and the valid range, for current and delayed scaling."""
    x, w = jnp.ones((2, 3)), jnp.ones((3, 2))
    said = f"margin must be an integer from 0 to 14, got {margin!r}"
    for state in (None, init_gemm_fp8_state(4)):
        with pytest.raises(ValueError, match=re.escape(f"fp8_dot_general's {said}")):
            fp8_dot_general(x, w, DN, fp8_state=state, margin=margin)
    with pytest.raises(ValueError, match=re.escape(f"Fp8Recipe.{said}")):
        jaxamp.Fp8Recipe("delayed", margin=margin)


def test_an_integer_margin_of_any_integer_type_is_taken():
    """``np.int64(2)`` is a margin of 2, as ``Fp8Recipe`` takes it."""
    x = jax.random.normal(jax.random.key(0), (4, 8)) * 10.0 ** jnp.linspace(-4, 0, 8)
    w = jax.random.normal(jax.random.key(1), (8, 3))
    np.testing.assert_array_equal(
        fp8_dot_general(x, w, DN, margin=np.int64(2)), fp8_dot_general(x, w, DN, margin=2)
    )
    assert jaxamp.Fp8Recipe(margin=np.int64(2)).margin == 2
    assert jaxamp.Fp8Recipe(margin=jnp.int32(2)).margin == 2


@pytest.mark.parametrize("margin", [0, 7, 14])
def test_the_largest_margin_still_multiplies_exactly(margin):
    """Up to the largest margin the amax lands on a normal float8 number: a product of
    powers of two comes out exact but for the float32 rounding of the scales (1.10 at
    margin 16)."""
    x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
    np.testing.assert_allclose(fp8_dot_general(x, w, DN, margin=margin), 1.5, rtol=1e-6)


def test_integer_operands_are_left_to_lax():
    a = jnp.ones((2, 3), jnp.int32)
    assert fp8_dot_general(a, a.T, DN).dtype == jnp.int32


@pytest.mark.parametrize("delayed", [False, True])
def test_vmap_scales_the_batch_as_one_tensor(delayed):
    """Under ``vmap`` the amax is the whole batch's, as for the stacked tensor without it,
    so results match the unbatched call and the state stays unbatched."""
    state = init_gemm_fp8_state(4) if delayed else None
    xs = (
        jax.random.normal(jax.random.key(0), (3, 2, 5))
        * jnp.array([1.0, 10.0, 100.0])[:, None, None]
    )
    w = jax.random.normal(jax.random.key(1), (5, 4))
    batched = jax.vmap(lambda x: fp8_dot_general(x, w, DN, fp8_state=state))(xs)
    stacked = fp8_dot_general(xs.reshape(6, 5), w, DN, fp8_state=state).reshape(3, 2, 4)
    np.testing.assert_array_equal(batched, stacked)


@hypothesis.settings(deadline=None, max_examples=8)
@hypothesis.given(
    st.lists(st.sampled_from([1e-3, 0.1, 1.0, 30.0, 1e3]), min_size=2, max_size=3),
    st.booleans(),
)
def test_vmap_over_a_batched_state_scales_each_member_as_run_alone(factors, shared_input):
    """An ensemble: weights and states stacked, run by ``vmap``. Each member's amaxes,
    scales and results are the member's own, as in a loop over the members (a whole-batch
    amax had scaled every member by the largest one's)."""
    k = len(factors)
    scale = jnp.array(factors)[:, None, None]
    ws = jax.random.normal(jax.random.key(1), (k, 5, 4)) * scale
    xs = jax.random.normal(jax.random.key(0), (k, 2, 5)) * scale[::-1]
    x_axis = None if shared_input else 0
    states = jax.tree.map(lambda v: jnp.stack([v] * k), init_gemm_fp8_state(4))

    def loss(w, state, x):
        return jnp.sum(fp8_dot_general(x, w, DN, fp8_state=state) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    batched = jax.jit(jax.vmap(step, in_axes=(0, 0, x_axis)))
    for _ in range(3):  # the state's second step quantizes with the first's amaxes
        got_loss, (got_dw, got_states) = batched(ws, states, xs[0] if shared_input else xs)
        for i in range(k):
            state = jax.tree.map(lambda v, i=i: v[i], states)
            want_loss, (want_dw, want_state) = step(ws[i], state, xs[0] if shared_input else xs[i])
            np.testing.assert_allclose(got_loss[i], want_loss, rtol=1e-6)
            np.testing.assert_allclose(got_dw[i], want_dw, rtol=1e-6)
            for name in Fp8State._fields:
                np.testing.assert_allclose(
                    getattr(got_states, name)[i], getattr(want_state, name), rtol=1e-6, err_msg=name
                )
        states = got_states


@pytest.mark.parametrize("saving", [None, "everything_saveable"])
@pytest.mark.parametrize("delayed", [False, True])
def test_a_gemm_inside_checkpoint_matches_it_outside(delayed, saving):
    """jax.checkpoint around the GEMM (and the state's max-combination) changes nothing,
    traced whole and op by op (run again under each of the next JAX's flags by
    tests/next_jax_test.py). A policy that saves the e4m3 operands had made every
    gradient NaN: JAX rounds saved residuals with reduce_precision(4 exponent bits, 3
    mantissa bits), an IEEE-like format whose largest value is 240, where e4m3fn's is 448."""
    policy = saving and getattr(jax.checkpoint_policies, saving)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3))
    state = init_gemm_fp8_state(4) if delayed else None

    def gemm(x, w, state):
        return fp8_dot_general(x, w, DN, fp8_state=None if state is None else max_combined(state))

    def loss(gemm, w, state):
        return jnp.sum(jnp.tanh(gemm(x, w, state)) ** 2)

    argnums = (0, 1) if delayed else 0
    for run in (jax.jit, lambda f: f):
        want, got = (
            run(jax.grad(functools.partial(loss, g), argnums=argnums))(w, state)
            for g in (gemm, jax.checkpoint(gemm, policy=policy))
        )
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_state_as_a_mapping_of_its_names_is_the_same_state():
    """A state Orbax restores without a target (a dict of the six names) gives the GEMM and
    next state of the Fp8State it came from (it was refused as a stack's state)."""
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3))
    state = jax.tree.map(lambda v: v + 0.5, init_gemm_fp8_state(4))

    def loss(w, state):
        return jnp.sum(fp8_dot_general(x, w, DN, fp8_state=state) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want_loss, (want_dw, want_state) = step(w, state)
    got_loss, (got_dw, got_states) = step(w, dict(state._asdict()))
    np.testing.assert_array_equal(got_loss, want_loss)
    np.testing.assert_array_equal(got_dw, want_dw)
    for name in Fp8State._fields:
        np.testing.assert_array_equal(got_states[name], getattr(want_state, name), name)
