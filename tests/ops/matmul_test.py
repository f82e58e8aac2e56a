"""The 16-bit matmul rule: forward and backward GEMMs, their layouts, and every layer path."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import jaxamp
from jaxamp._src.ops.forms import FORMS
from jaxamp._src.ops.matmul import amp_conv_general_dilated, amp_dot_general
from tests.helpers.expected_warnings import NATIVE_FORM_ON_CPU

SIXTEEN = [jnp.bfloat16, jnp.float16]
# The forms this backend runs: XLA:CPU fails on some bfloat16 dots of the native form.
RUNNABLE_FORMS = [f for f in FORMS if f != "native" or jax.default_backend() != "cpu"]
DENSE = (((2,), (0,)), ((), ()))  # [batch, length, in] x [in, out]
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _inputs(dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(0), (2, 8, 16)).astype(dtype)
    w = 0.2 * jax.random.normal(jax.random.key(1), (16, 32))
    return x, w


def _loss(compute_dtype, form=None):
    def loss(x, w):
        y = amp_dot_general(x, w, DENSE, compute_dtype=compute_dtype, form=form)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    return loss


def _reference_loss(x, w):
    return jnp.sum(jnp.sin(lax.dot_general(x, w, DENSE, precision="highest")))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# every form on purpose, the native one on XLA:CPU included
@NATIVE_FORM_ON_CPU
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_all_three_gemms_take_16bit_operands_and_accumulate_in_float32(dtype, form):
    x, w = _inputs(dtype)
    grad = jax.grad(_loss(dtype, FORMS[form]), argnums=(0, 1))
    report = jaxamp.precision_report(grad)(x, w)
    name = np.dtype(dtype).name
    assert report.count(kind="dot_general") == 3, report  # forward, d_x, d_w
    assert {op.direction for op in report.ops} == {"forward", "backward"}
    for op in report.ops:
        assert (op.lhs_dtype, op.rhs_dtype, op.result_dtype) == (name, name, "float32"), op


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_gradients_come_back_in_the_operands_dtypes(dtype):
    x, w = _inputs(dtype)
    y = jax.jit(lambda x, w: amp_dot_general(x, w, DENSE, compute_dtype=dtype))(x, w)
    dx, dw = jax.jit(jax.grad(_loss(dtype), argnums=(0, 1)))(x, w)
    assert y.dtype == dtype  # activations stay 16-bit
    assert dx.dtype == dtype  # activation gradients in the compute dtype
    assert dw.dtype == jnp.float32  # the float32 weight gets a float32 gradient


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_weight_gradient_is_not_rounded_to_16_bits(dtype):
    """d_w equals the float32 product of the 16-bit operands, not its 16-bit rounding."""
    x, w = _inputs(dtype)
    g = jax.random.normal(jax.random.key(2), (2, 8, 32)).astype(dtype)

    def f(w):
        return amp_dot_general(x, w, DENSE, compute_dtype=dtype)

    _, vjp = jax.vjp(f, w)
    (dw,) = jax.jit(vjp)(g)
    exact = jnp.einsum(
        "bli,blo->io", x.astype(jnp.float32), g.astype(jnp.float32), precision="highest"
    )
    assert _rel(dw, exact) < 1e-5
    assert _rel(exact.astype(dtype), exact) > 1e-4  # so a 16-bit rounding would be caught


@pytest.mark.parametrize("dtype", [*SIXTEEN, jnp.float32])
def test_gradients_close_to_float32(dtype):
    x, w = _inputs()
    ours = jax.jit(jax.grad(_loss(dtype), argnums=(0, 1)))(x, w)
    reference = jax.grad(_reference_loss, argnums=(0, 1))(x, w)
    tolerance = TOLERANCE.get(dtype, 1e-5)
    for a, b in zip(ours, reference, strict=True):
        assert _rel(a, b) < tolerance


def test_float32_compute_is_a_plain_dot_general():
    x, w = _inputs()
    jaxpr = jax.make_jaxpr(lambda x, w: amp_dot_general(x, w, DENSE, compute_dtype=jnp.float32))
    assert [e.primitive.name for e in jaxpr(x, w).jaxpr.eqns] == ["dot_general"]


def test_the_16bit_weight_copy_is_not_saved_for_the_backward_pass():
    x, w = _inputs(jnp.bfloat16)
    saved = jaxamp.ops.saved_residuals(lambda x, w: _loss(jnp.bfloat16)(x, w), x, w)
    shapes = [(tuple(aval.shape), np.dtype(aval.dtype).name) for aval, _ in saved]
    assert ((16, 32), "bfloat16") not in shapes, shapes
    assert ((16, 32), "float32") in shapes  # the weight the caller holds anyway


def _lhs_contracts_last(text: str) -> list[bool]:
    out = []
    for line in text.splitlines():
        m = re.search(r"contracting_dims = \[([\d, ]+)\] x .*: \(tensor<([\dx]+)x\w+>", line)
        if m and "stablehlo.dot_general" in line:
            lhs_rank = len(m.group(2).split("x"))
            out.append([int(d) for d in m.group(1).split(",")] == [lhs_rank - 1])
    return out


# the native form beside the canonical one, on purpose
@NATIVE_FORM_ON_CPU
def test_canonical_form_lays_out_every_gemm_with_its_contraction_last():
    """The weight-gradient GEMM contracts dim 0 of both operands unless transposed first."""
    x, w = _inputs(jnp.bfloat16)
    text = jax.jit(jax.grad(_loss(jnp.bfloat16, FORMS["canonical"]), argnums=(0, 1)))
    contracts_last = _lhs_contracts_last(text.lower(x, w).as_text())
    assert len(contracts_last) == 3 and all(contracts_last), contracts_last
    plain = jax.jit(jax.grad(_loss(jnp.bfloat16, FORMS["native"]), argnums=(0, 1)))
    assert not all(_lhs_contracts_last(plain.lower(x, w).as_text()))


@pytest.mark.filterwarnings("ignore:The 'native' matmul form on XLA")
def test_the_override_reaches_the_program():
    x, w = _inputs(jnp.bfloat16)
    for name in FORMS:
        with jaxamp.ops.use_matmul_form(name):
            report = jaxamp.precision_report(jax.grad(_loss(jnp.bfloat16), argnums=(0, 1)))(x, w)
        assert {op.upcast for op in report.ops} == {name == "upcast"}, name


@pytest.mark.parametrize("form", RUNNABLE_FORMS)
def test_under_vmap_remat_scan(form):
    x, w = _inputs(jnp.bfloat16)
    loss = _loss(jnp.bfloat16, FORMS[form])
    expected = jax.grad(loss, argnums=1)(x, w)
    per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None)))
    summed = per_example(x[:, None], w).sum(0)
    assert _rel(summed, expected) < 1e-5
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=1))(x, w)
    assert _rel(remat, expected) < 1e-6

    def scanned(x, w):
        def body(carry, xi):
            return carry + loss(xi[None], w), None

        return lax.scan(body, jnp.zeros([], jnp.float32), x)[0]

    assert _rel(jax.jit(jax.grad(scanned, argnums=1))(x, w), expected) < 1e-5


def test_under_shard_map():
    """A replicated weight times a sharded batch: its gradient is summed over the mesh, as JAX's."""
    x, w = _inputs(jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def grads(loss):
        local = jax.grad(loss, argnums=1)
        specs = dict(in_specs=(PartitionSpec("data"), PartitionSpec()), out_specs=PartitionSpec())
        return jax.jit(jax.shard_map(local, mesh=mesh, **specs))(x, w)

    def plain(x, w):
        y = lax.dot_general(x, w.astype(jnp.bfloat16), DENSE, preferred_element_type=jnp.float32)
        return jnp.sum(jnp.sin(y.astype(jnp.bfloat16).astype(jnp.float32)))

    ours, theirs = grads(_loss(jnp.bfloat16)), grads(plain)
    assert _rel(ours, theirs) < 1e-2
    assert _rel(ours, jax.grad(_loss(jnp.bfloat16), argnums=1)(x, w)) < 1e-5


def test_traces_once():
    traces = []

    @jax.jit
    def step(x, w):
        traces.append(None)
        return jax.grad(_loss(jnp.bfloat16), argnums=1)(x, w)

    x, w = _inputs(jnp.bfloat16)
    for _ in range(3):
        step(x, w).block_until_ready()
    assert len(traces) == 1


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_convolution_rule(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    k = 0.3 * jax.random.normal(jax.random.key(1), (3, 3, 3, 5))
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(x, k):
        y = amp_conv_general_dilated(
            x.astype(dtype), k, (2, 2), "SAME", dimension_numbers=dn, compute_dtype=dtype
        )
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    def reference(x, k):
        y = lax.conv_general_dilated(
            x, k, (2, 2), "SAME", dimension_numbers=dn, precision="highest"
        )
        return jnp.sum(jnp.sin(y))

    grad = jax.grad(loss, argnums=(0, 1))
    report = jaxamp.precision_report(grad)(x, k)
    name = np.dtype(dtype).name
    assert report.count(kind="convolution") == 3, report
    for op in report.ops:
        assert (op.lhs_dtype, op.rhs_dtype, op.result_dtype) == (name, name, "float32"), op
    dx, dk = jax.jit(grad)(x, k)
    assert dk.dtype == jnp.float32
    ref = jax.grad(reference, argnums=(0, 1))(x, k)
    assert _rel(dx, ref[0]) < TOLERANCE[dtype] and _rel(dk, ref[1]) < TOLERANCE[dtype]


# ------------------------------------------------------------------ every layer path


class LinenLayers(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(50, 16)
        h = embed(tokens)  # [batch, length, 16]
        h = nn.Dense(16)(h)
        h = nn.DenseGeneral((2, 8))(h)
        h = nn.Einsum((2, 8, 16), "bthd,hdo->bto")(h)
        h = nn.MultiHeadDotProductAttention(num_heads=2)(h)
        h = nn.Conv(16, (3,))(h)
        return embed.attend(h) + nn.Dense(1)(h)  # a Dense to one feature, on any backend


class NNXLayers(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(50, 16, rngs=rngs)
        self.dense = nnx.Linear(16, 16, rngs=rngs)
        self.general = nnx.LinearGeneral(16, (2, 8), rngs=rngs)
        self.einsum = nnx.Einsum("bthd,hdo->bto", (2, 8, 16), rngs=rngs)
        self.attention = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
        self.conv = nnx.Conv(16, 16, (3,), rngs=rngs)
        self.one = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, tokens):
        h = self.general(self.dense(self.embed(tokens)))
        h = self.conv(self.attention(self.einsum(h)))
        return self.embed.attend(h) + self.one(h)


def _assert_rule_everywhere(report, dtype):
    name = np.dtype(dtype).name
    assert report.ops
    for op in report.ops:
        assert (op.lhs_dtype, op.rhs_dtype, op.result_dtype) == (name, name, "float32"), op


TOKENS = jnp.arange(12).reshape(2, 6) % 50


def _assert_all_leaves_close(grads, expected, tolerance):
    """Every gradient leaf within ``tolerance`` of float32's, relative to its own size or, for
    gradients that are zero in exact arithmetic (attention's key bias), to a hundredth of
    the typical leaf's."""
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    references = jax.tree.leaves(expected)
    assert len(leaves) == len(references) >= 10  # every layer's params
    floor = 0.01 * float(np.median([np.linalg.norm(np.asarray(e)) for e in references]))
    for (path, g), e in zip(leaves, references, strict=True):
        assert g.dtype == jnp.float32 and g.shape == e.shape
        error = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(e, np.float64))
        scale = max(float(np.linalg.norm(np.asarray(e))), floor)
        assert error <= tolerance * scale, (jax.tree_util.keystr(path), error / scale)


@pytest.mark.parametrize("form", RUNNABLE_FORMS)
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_every_linen_layer_runs_under_the_rule(dtype, form):
    policy = jaxamp.get_policy(f"p=f32,c={np.dtype(dtype).name},o=f32")
    model = jaxamp.linen.apply_policy(LinenLayers(), policy)
    params = jax.jit(model.init)(jax.random.key(0), TOKENS)["params"]

    def loss(params):
        return jnp.mean(model.apply({"params": params}, TOKENS) ** 2)

    with jaxamp.ops.use_matmul_form(form):
        _assert_rule_everywhere(jaxamp.precision_report(jax.grad(loss))(params), dtype)
        grads = jax.jit(jax.grad(loss))(params)
    reference = jax.jit(
        jax.grad(lambda p: jnp.mean(LinenLayers().apply({"params": p}, TOKENS) ** 2))
    )
    _assert_all_leaves_close(grads, reference(params), 5 * TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_every_nnx_layer_runs_under_the_rule(dtype):
    policy = jaxamp.get_policy(f"p=f32,c={np.dtype(dtype).name},o=f32")
    model = jaxamp.nnx.apply_policy(NNXLayers(nnx.Rngs(0)), policy)

    def loss(model):
        return jnp.mean(model(TOKENS) ** 2)

    graphdef, state = nnx.split(model)
    report = jaxamp.precision_report(jax.grad(lambda s: loss(nnx.merge(graphdef, s))))(state)
    _assert_rule_everywhere(report, dtype)
    grads = nnx.state(nnx.jit(nnx.grad(loss))(model))
    expected = nnx.state(nnx.jit(nnx.grad(loss))(NNXLayers(nnx.Rngs(0))))
    _assert_all_leaves_close(grads, expected, 5 * TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_conv_transpose_kernel_gradient_is_not_rounded(dtype):
    """Flax's ConvTranspose casts its kernel before the convolution; the rule reads the
    float32 kernel, so its gradient is the GEMM's float32 result."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    model = jaxamp.linen.apply_policy(
        nn.ConvTranspose(4, (3, 3)), f"p=f32,c={np.dtype(dtype).name}"
    )
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, x).astype(jnp.float32).sum()))(
        params
    )
    kernel = grads["kernel"]
    assert kernel.dtype == jnp.float32
    assert not bool(jnp.all(kernel.astype(dtype).astype(jnp.float32) == kernel))


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_a_float32_input_gradient_is_not_rounded(dtype):
    """Both rules give a float32 operand a float32 gradient (the convolution rounded it)."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    k = 0.3 * jax.random.normal(jax.random.key(1), (3, 3, 3, 5))
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x):
        y = amp_conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=dn, compute_dtype=dtype
        )
        return y.astype(jnp.float32).sum()

    def dot(x):
        return (
            amp_dot_general(x, k[0, 0], (((3,), (0,)), ((), ())), compute_dtype=dtype)
            .astype(jnp.float32)
            .sum()
        )

    for f in (conv, dot):
        dx = jax.jit(jax.grad(f))(x)
        assert dx.dtype == jnp.float32
        assert not bool(jnp.all(dx.astype(dtype).astype(jnp.float32) == dx)), f.__name__


def test_a_precision_given_by_name_is_kept():
    """Names are read as lax.dot_general reads them; a dot algorithm's gives way to the rule."""
    x, w = _inputs(jnp.bfloat16)

    def precision_of(precision):
        f = lambda x, w: amp_dot_general(x, w, DENSE, precision, compute_dtype=jnp.bfloat16)
        (eqn,) = [
            e for e in jax.make_jaxpr(f)(x, w).jaxpr.eqns if e.primitive.name == "amp_dot_general"
        ]
        return eqn.params["precision"]

    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    assert precision_of("highest") == precision_of("float32") == highest
    assert precision_of(lax.Precision.HIGHEST) == lax.Precision.HIGHEST
    assert precision_of("BF16_BF16_F32") is None  # an algorithm: the rule's own
    with pytest.raises(ValueError, match=r"Unknown precision 'hihgest'\. Valid choices: .*highest"):
        amp_dot_general(x, w, DENSE, "hihgest", compute_dtype=jnp.bfloat16)


def test_the_form_is_the_lowering_platforms():
    """Exported for a GPU from this host, the rule takes the GPU's form (no layouts
    materialised behind barriers); for a CPU, the canonical one."""
    x, w = _inputs(jnp.bfloat16)
    f = jax.jit(jax.grad(_loss(jnp.bfloat16), argnums=(0, 1)))
    barriers = {
        platform: jax.export.export(f, platforms=(platform,))(x, w)
        .mlir_module()
        .count("optimization_barrier")
        for platform in ("cpu", "cuda")
    }
    assert barriers["cuda"] == 0 and barriers["cpu"] > 0, barriers
    with jaxamp.ops.use_matmul_form("upcast"):  # an override holds for every platform
        exported = jax.export.export(jax.jit(jax.grad(_loss(jnp.bfloat16))), platforms=("cuda",))
        assert "optimization_barrier" not in exported(x, w).mlir_module()


def test_linear_transpose_through_the_rule():
    x, w = _inputs(jnp.bfloat16)
    f = lambda w: amp_dot_general(x, w, DENSE, compute_dtype=jnp.bfloat16)
    g = jnp.ones((2, 8, 32), jnp.bfloat16)
    (ours,) = jax.linear_transpose(f, w)(g)
    exact = jnp.einsum("bli,blo->io", x.astype(jnp.float32), g.astype(jnp.float32))
    assert ours.dtype == jnp.float32 and _rel(ours, exact) < 1e-5


def test_an_integer_preferred_type_is_left_to_jax():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    dn = (((1,), (0,)), ((), ()))
    out = amp_dot_general(x, w, dn, preferred_element_type=jnp.int32, compute_dtype=jnp.bfloat16)
    assert out.dtype == lax.dot_general(x, w, dn, preferred_element_type=jnp.int32).dtype
