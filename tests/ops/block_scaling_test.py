"""The block-scaled formats (MXFP8, NVFP4) against an independent numpy/ml_dtypes emulation of
the OCP MX and NVFP4 formats: quantization element for element, the three GEMMs within
float32's summation, and JAX's own MXFP8 quantizer bit for bit."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src.ops.block_gemm import _backward, block_dot_general
from jaxamp._src.ops.block_scaling import NVFP4, block_format, quantize_blocks
from tests.helpers import block_reference as ref

FORMATS = ("mxfp8", "nvfp4")
# Values that test the formats' edges: zeros, float32 subnormals, e4m3's and e2m1's largest
# and the values just past them, a huge and a tiny magnitude beside ordinary ones.
EDGES = (0.0, -0.0, 1e-40, -3e-39, 448.0, 449.0, 6.0, 6.5, 1e30, -1e-30, 2.0**-127, 3.4e38)


@st.composite
def _matrices(draw, max_rows=20, max_cols=80, nonfinite=False, cols=None):
    rows = draw(st.integers(1, max_rows))
    cols = cols or draw(st.integers(1, max_cols))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, cols)) * np.exp2(rng.integers(-20, 20, size=(rows, 1)))
    x = x.astype(np.float32)
    for _ in range(draw(st.integers(0, 6))):
        edges = EDGES + ((np.inf, -np.inf, np.nan) if nonfinite else ())
        i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        x[i, j] = draw(st.sampled_from(edges))
    return x


def _ours(x, fmt, tiles=False):
    q = jax.jit(lambda v: quantize_blocks(v, fmt, tiles=tiles))(jnp.asarray(x, jnp.float32))
    return np.asarray(q.dequantized(), np.float64), float(q.tensor_scale)


def _same(a, b):
    """Equal element for element, NaN where the other is NaN."""
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b))


# The generated tests' budgets: a few dozen examples in CI, ten times more under ``slow``.
BUDGETS = [
    pytest.param(1, id="ci"),
    pytest.param(10, id="ten-times", marks=pytest.mark.slow),
]


def _budget(examples: int, factor: int):
    return hypothesis.settings(max_examples=examples * factor, deadline=None, derandomize=True)


@pytest.mark.compiler_sensitive
@pytest.mark.parametrize("factor", BUDGETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_matches_the_numpy_emulation_element_for_element(fmt, factor):
    _budget(25, factor)(
        hypothesis.given(x=_matrices(nonfinite=True), tiles=st.booleans())(
            lambda x, tiles: _quantization_matches(fmt, x, tiles)
        )
    )()


def _quantization_matches(fmt, x, tiles):
    tiles = tiles and fmt == "nvfp4"
    got, got_tensor = _ours(x, fmt, tiles)
    want, want_tensor = ref.dequantized(x, fmt, tiles)
    _same(got, want)
    assert got_tensor == want_tensor or (np.isnan(got_tensor) and np.isnan(want_tensor))


@pytest.mark.compiler_sensitive
def test_nvfp4_rounds_a_fine_grid_as_ml_dtypes_does():
    """Every block holds 6 (its scale is then 1, up to the tensor scale's rounding) and 15
    values of a grid over [-6, 6]: each lands where ml_dtypes's e2m1 puts it. XLA:CPU's
    older fusion emitters, which the tests compile with, convert float32 to e2m1 wrongly
    (-5.0019 to -4, not -6): jaxamp rounds to the grid itself first."""
    grid = np.linspace(-6, 6, 15 * 8001, dtype=np.float32).reshape(-1, 15)
    x = np.concatenate([np.full((len(grid), 1), 6, np.float32), grid], axis=1)
    got, _ = _ours(x, "nvfp4")
    want, _ = ref.dequantized(x, "nvfp4")
    _same(got, want)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's arithmetic")
def test_xla_cpu_reads_float32_subnormals_as_zero_which_the_reference_models():
    x = jnp.float32(1e-40)
    assert float(jax.jit(lambda v: v * 2.0**100)(x)) == 0.0
    assert ref.flushed(np.array([1e-40, 1e-30], np.float32)).tolist()[0] == 0.0


def test_an_amax_whose_quotient_is_subnormal_still_gets_a_scale_that_holds_it():
    # amax / 448 near 9e-39 is a float32 subnormal, which XLA:CPU flushes to zero: the
    # scale came out 2**-127, half the one needed, and the block's largest value clipped.
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 4e-36, -1e-36
    got, _ = _ours(x, "mxfp8")
    want, _ = ref.dequantized(x, "mxfp8")
    _same(got, want)
    assert got[0, 0] == pytest.approx(4e-36, rel=0.07)


@pytest.mark.parametrize("tensor_amax", [1e-33, 1e-32])
def test_an_nvfp4_block_far_below_its_tensors_amax_keeps_its_values(tensor_amax):
    # The block's decode scale times the tensor's is then a float32 subnormal, which
    # XLA:CPU reads as zero: its reciprocal, clipped, made every value the block's largest.
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = tensor_amax
    x[0, 16:20] = [6e-38, 3e-38, 2e-38, 1.5e-38]
    got, tensor = _ours(x, "nvfp4")
    want, want_tensor = ref.dequantized(x, "nvfp4")
    _same(got, want)
    assert tensor == want_tensor
    # four values, in order, no longer four copies of the largest (the scale, an e4m3
    # subnormal at 1e-32, is coarse enough that the largest clips: the format's doing)
    decoded = got[0, 16:20] * tensor
    assert np.all(np.diff(decoded) < 0) and decoded[-1] > 0


def test_the_mx_scale_rounds_up_so_that_no_value_clips():
    # 449 would clip to 448 with the OCP spec's floor; the scale rounded up holds it.
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [449.0, 1.0, 0.5]
    q = quantize_blocks(jnp.asarray(x), "mxfp8")
    assert float(q.block_scales.astype(jnp.float32)[0, 0]) == 2.0
    assert float(q.dequantized()[0, 0]) == 448.0  # 449 / 2 = 224.5 rounds to 224 in e4m3
    assert np.all(np.abs(np.asarray(q.values.astype(jnp.float32))) <= 448)


def test_a_block_with_inf_or_nan_decodes_to_nan_and_leaves_the_other_blocks():
    x = np.ones((2, 64), np.float32)
    x[0, 3] = np.inf
    x[1, 40] = np.nan
    d = np.asarray(quantize_blocks(jnp.asarray(x), "mxfp8").dequantized())
    assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:]).all()
    assert (d[0, 32:] == 1).all() and (d[1, :32] == 1).all()
    q = quantize_blocks(jnp.asarray(x), "nvfp4")
    assert np.isnan(float(q.tensor_scale))  # NVFP4: the tensor's scale, hence every value


def test_a_tail_shorter_than_a_block_is_its_own_block_padded_with_zeros():
    x = np.arange(1, 41, dtype=np.float32)[None]  # 32 + a tail of 8
    q = quantize_blocks(jnp.asarray(x), "mxfp8")
    assert q.values.shape == (1, 64)
    scales = np.asarray(q.block_scales.astype(jnp.float32))[0]
    assert scales[1] == 0.125  # the tail's own amax (40), not the first block's (32)
    assert (np.asarray(q.values.astype(jnp.float32))[0, 40:] == 0).all()


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
def test_mxfp8_matches_jaxs_own_quantizer_bit_for_bit():
    from jax._src.cudnn import scaled_matmul_stablehlo as jax_mx

    config = jax_mx.BlockScaleConfig(
        "mxfp8", 32, jnp.float8_e4m3fn, jnp.float8_e8m0fnu, None, False
    )
    x = np.random.default_rng(0).normal(size=(3, 8, 96)).astype(np.float32)
    x[0, 0, :32] *= 1e-30
    x[1, 2, 32:64] = 0
    jq, js = jax_mx.quantize(jnp.asarray(x), config)
    q = quantize_blocks(jnp.asarray(x), "mxfp8")
    ours, theirs = (np.asarray(v.view(jnp.uint8)) for v in (q.values, jq))
    # An all-zero block: JAX divides by its scale 2**-127, a subnormal XLA:CPU reads as
    # zero, and gets 0 / 0 (NaN) on a CPU; here it is zeros, as the format defines it.
    zero = np.repeat(np.all(x.reshape(3, 8, 3, 32) == 0, axis=-1), 32, axis=-1)
    np.testing.assert_array_equal(ours[~zero], theirs[~zero])
    assert (np.asarray(q.dequantized())[zero] == 0).all()
    np.testing.assert_array_equal(
        np.asarray(q.block_scales.view(jnp.uint8)), np.asarray(js.view(jnp.uint8))
    )


def test_jaxs_scaled_dot_general_is_no_reference_on_cpu():
    # On a CPU jax.nn.scaled_dot_general computes the float32 product, unquantized: it
    # cannot stand in for the formats here, which is why the numpy emulation does.
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(1, 3, 32)), jnp.float32)
    dn = (((2,), (2,)), ((0,), (0,)))
    theirs = jax.nn.scaled_dot_general(x, w, dn, preferred_element_type=jnp.float32)
    exact = jax.lax.dot_general(x, w, dn, precision="highest")
    ours = block_dot_general(x, w, dn, "mxfp8", jnp.float32)
    if jax.default_backend() == "cpu":
        np.testing.assert_allclose(theirs, exact, rtol=1e-6)
    assert not np.allclose(ours, exact, rtol=1e-4)


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_emulated_gemm_is_jaxs_own_scaled_dot(fmt):
    """The GEMM of quantized operands against ``jax.lax.scaled_dot``, XLA's block-scaled
    dot (on a CPU its decomposition: each value times its block's scale, float32 sums):
    the same values and scales, within the order of float32's sums."""
    from jaxamp._src.ops.block_gemm import _block_matmul

    rng = np.random.default_rng(3)
    a = rng.normal(size=(2, 5, 96)) * np.exp2(rng.integers(-8, 8, size=(2, 5, 96)))
    b = rng.normal(size=(2, 7, 96))
    qa, qb = (quantize_blocks(jnp.asarray(x, jnp.float32), fmt) for x in (a, b))
    f = block_format(fmt)
    ours = jax.jit(lambda *v: _block_matmul(*v, f))(
        qa.values, qb.values, qa.block_scales, qb.block_scales
    )
    theirs = jax.jit(
        lambda x, y, sx, sy: jax.lax.scaled_dot(
            x,
            y,
            lhs_scale=sx,
            rhs_scale=sy,
            dimension_numbers=(((2,), (2,)), ((0,), (0,))),
            preferred_element_type=jnp.float32,
        )
    )(qa.values, qb.values, qa.block_scales, qb.block_scales)
    decoded = [np.asarray(_decoded_blocks(q), np.float64) for q in (qa, qb)]
    bound = np.stack([_sum_bound(x, y) for x, y in zip(*decoded, strict=True)])
    assert np.abs(ours).max() > 0
    assert np.all(np.abs(np.asarray(ours, np.float64) - np.asarray(theirs)) <= 2 * bound)


def _decoded_blocks(q):
    """``q``'s values times their block scales (not the tensor's scale), as the GEMM takes
    them."""
    return q.values.astype(jnp.float32) * jnp.repeat(
        q.block_scales.astype(jnp.float32), q.fmt.block, axis=-1
    )


def test_on_a_blackwell_gpu_the_gemm_is_jaxs_scaled_matmul_lowered_to_cudnn(monkeypatch):
    """Where every device has the block-scaled GEMM, the forward and both gradient GEMMs
    are ``jax.nn.scaled_matmul``, which JAX lowers for CUDA to the block-scaled dot that
    XLA hands to cuDNN (lowered here for CUDA without a GPU; no Blackwell ran it)."""
    from jaxamp._src.ops import block_gemm

    monkeypatch.setattr(block_gemm, "has_block_scaled_gemm", lambda: True)
    dn = (((1,), (1,)), ((), ()))

    def loss(x, w):
        return block_dot_general(x, w, dn, "mxfp8", jnp.float32).sum()

    x, w = jnp.ones((4, 64)), jnp.ones((8, 64))
    step = jax.value_and_grad(loss, argnums=(0, 1))  # the forward's value kept
    jaxpr = str(jax.make_jaxpr(step)(x, w))
    assert jaxpr.count("scaled_matmul") >= 3, jaxpr
    try:
        lowered = jax.jit(step).trace(x, w).lower(lowering_platforms=("cuda",))
    except Exception as error:  # a jaxlib without CUDA's lowering rules
        pytest.skip(f"this jaxlib cannot lower for CUDA: {error}")
    assert lowered.as_text().count("__op$block_scaled_dot") == 3


def _sum_bound(a, b):
    """The error float32 sums of ``k`` exact products allow: (k + 2) * 2**-24 times the
    sum of their magnitudes (plus the tensor scales' two roundings)."""
    k = a.shape[1]
    return (k + 2) * 2.0**-24 * (np.abs(a) @ np.abs(b).T) + 1e-45


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("factor", BUDGETS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_forward_gemm_matches_the_numpy_emulation(fmt, dtype, factor):
    _budget(6, factor)(
        hypothesis.given(data=st.data())(lambda data: _forward_matches(fmt, dtype, data))
    )()


def _forward_matches(fmt, dtype, data):
    a = data.draw(_matrices(12, 70))
    b = data.draw(_matrices(12, cols=a.shape[1]))
    with np.errstate(over="ignore"):
        a, b = (np.asarray(jnp.asarray(m).astype(dtype).astype(jnp.float32)) for m in (a, b))
    dn = (((1,), (1,)), ((), ()))
    got = np.asarray(
        jax.jit(lambda x, y: block_dot_general(x, y, dn, fmt, jnp.float32))(
            jnp.asarray(a, dtype), jnp.asarray(b, dtype)
        ),
        np.float64,
    )
    want = ref.block_matmul(a, b, fmt)
    qa, sa = ref.dequantized(a, fmt)
    qb, sb = ref.dequantized(b, fmt, tiles=fmt == "nvfp4")
    with np.errstate(invalid="ignore", over="ignore"):
        bound = _sum_bound(qa, qb)[: a.shape[0], : b.shape[0]] * abs(sa * sb)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    assert np.all(np.abs(got[finite] - want[finite]) <= bound[finite] * 1.0001)


def _gradient_reference(a, b, g, fmt):
    """The activation and weight gradients' GEMMs in numpy: ``g @ b`` with blocks along n
    (``b`` in its forward tiles under NVFP4) and ``g.T @ a`` with blocks along m."""
    if fmt == "nvfp4":
        qb, sb = ref.dequantized(b, fmt, tiles=True)
        qb = qb[: b.shape[0], : b.shape[1]]
    else:
        qbt, sb = ref.dequantized(b.T, fmt)
        qb = qbt[: b.shape[1], : b.shape[0]].T
    qg, sg = ref.dequantized(g, fmt)
    d_a = (qg[:, : g.shape[1]] @ qb) * (sg * sb)
    qgt, sgt = ref.dequantized(g.T, fmt)
    qat, sat = ref.dequantized(a.T, fmt)
    d_b = (qgt[:, : g.shape[0]] @ qat[:, : a.shape[0]].T) * (sgt * sat)
    return d_a, d_b


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("fmt", FORMATS)
@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(
    seed=st.integers(0, 2**31 - 1), m=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40)
)
def test_the_gradient_gemms_match_the_numpy_emulation(fmt, seed, m, k, n):
    rng = np.random.default_rng(seed)
    a, b, g = (rng.normal(size=s).astype(np.float32) for s in ((m, k), (n, k), (m, n)))
    # Nearest rounding of the gradient, to compare value for value (stochastic rounding
    # is tested for its mean below).
    f = dataclasses.replace(block_format(fmt), gradient_rounding="nearest")
    d_a, d_b = jax.jit(lambda *v: _backward(f, *(x[None] for x in v)))(a, b, g)
    want_a, want_b = _gradient_reference(a, b, g, fmt)
    tol_a = (n + 2) * 2.0**-24 * np.abs(want_a).max() * 4 + 1e-30
    tol_b = (m + 2) * 2.0**-24 * np.abs(want_b).max() * 4 + 1e-30
    np.testing.assert_allclose(np.asarray(d_a[0]), want_a, rtol=0, atol=tol_a)
    np.testing.assert_allclose(np.asarray(d_b[0]), want_b, rtol=0, atol=tol_b)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    row = np.array([0.1, 0.3, 0.75, 1.2, 2.6, 3.5, 4.9, 5.99, -0.3, -4.5, 6.0], np.float32)
    x = np.tile(np.pad(row, (0, 5)), (4096, 1))  # one block of 16 per row
    q = quantize_blocks(jnp.asarray(x), NVFP4, rounding="stochastic", key=jax.random.key(0))
    got = np.asarray(q.values.astype(jnp.float32), np.float64)
    scaled = ref.nvfp4_scaled(x)[0][0]  # the value before rounding, the same in every row
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    lower = np.sign(scaled) * np.array([grid[grid <= abs(v)].max() for v in scaled])
    upper = np.sign(scaled) * np.array([grid[grid >= abs(v)].min() for v in scaled])
    assert np.all((got == lower) | (got == upper))
    # Unbiased: the mean within four standard errors of a two-point variable over the gap.
    error = np.abs(got.mean(axis=0) - scaled)
    assert np.all(error <= 4 * np.abs(upper - lower) / 2 / np.sqrt(len(x)) + 1e-7)
    # and not nearest rounding: the values between grid points took both neighbours
    between = lower != upper
    assert np.all(got[:, between].min(axis=0) != got[:, between].max(axis=0))


def test_nvfp4_weight_tiles_quantize_a_kernel_and_its_transpose_alike():
    w = np.random.default_rng(3).normal(size=(40, 24)).astype(np.float32)
    a = quantize_blocks(jnp.asarray(w), "nvfp4", tiles=True).dequantized()[:40, :24]
    b = quantize_blocks(jnp.asarray(w.T), "nvfp4", tiles=True).dequantized()[:24, :40]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_zero_gradient_gives_zero_gradients_not_nan(fmt):
    # A block of zeros takes the scale 2**-127 (MXFP8), a float32 subnormal: dividing by
    # it on XLA:CPU gave 0 / 0, and attention's query and key kernels NaN gradients.
    x, w = jnp.ones((4, 40)), jnp.ones((24, 40))
    dn = (((1,), (1,)), ((), ()))
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(block_dot_general(a, b, dn, fmt) * 0.0), (0, 1)))(
        x, w
    )
    assert all(bool(jnp.all(g == 0)) for g in grads)
    assert (np.asarray(quantize_blocks(jnp.zeros((2, 64)), fmt).dequantized()) == 0).all()


def _dx(x, w, g):
    dn = (((1,), (0,)), ((), ()))
    return jax.vjp(lambda v: block_dot_general(v, w, dn, "nvfp4"), x)[1](g)[0]


def test_stochastic_rounding_draws_other_bits_for_other_layers_and_for_minus_g():
    """With an identity weight the activation gradient is the rounded gradient itself.
    Its random bits had come from a plain sum of the gradient's bits: two layers given the
    same gradient rounded it alike, and ``-g`` rounded as the mirror of ``g``, a bias that
    does not average out."""
    rng = np.random.default_rng(0)
    x1, x2, g = (jnp.asarray(rng.normal(size=(16, 16)), jnp.float32) for _ in range(3))
    w = jnp.eye(16, dtype=jnp.float32)  # e2m1 holds 0 and 1 exactly: dx is SR(g)
    first, second = jax.jit(_dx)(x1, w, g), jax.jit(_dx)(x2, w, g)
    assert not bool(jnp.all(first == second))
    assert not bool(jnp.all(jax.jit(_dx)(x1, w, -g) == -first))
    # a new weight (the next step's) draws new bits too
    assert not bool(jnp.all(jax.jit(_dx)(x1, w * 1.5, g / 1.5) == first))


def test_nvfp4_scales_each_member_of_a_batched_gemm_as_if_alone():
    """An experts einsum (a dot_general batch axis): one tensor scale per expert, as a
    loop over the experts (and ``vmap``) gives, not one shared with a 100x larger one."""
    x = jax.random.normal(jax.random.key(0), (3, 8, 32)).at[1].multiply(100.0)
    w = jax.random.normal(jax.random.key(1), (3, 32, 16))
    batched = jax.jit(lambda a, b: block_dot_general(a, b, (((2,), (1,)), ((0,), (0,))), "nvfp4"))
    one = jax.jit(lambda a, b: block_dot_general(a, b, (((1,), (0,)), ((), ())), "nvfp4"))
    looped = jnp.stack([one(x[i], w[i]) for i in range(3)])
    np.testing.assert_array_equal(batched(x, w), looped)
    np.testing.assert_array_equal(jax.jit(jax.vmap(one))(x, w), looped)


def test_operands_sharded_in_explicit_mode_are_refused_by_name():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.ones((8 * jax.device_count(), 64)), NamedSharding(mesh, P("d", None)))
    f = jax.jit(lambda x, w: block_dot_general(x, w, (((1,), (0,)), ((), ())), "mxfp8"))
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"explicit sharding mode.*AxisType\.Auto"),
    ):
        f(x, jnp.ones((64, 16)))
