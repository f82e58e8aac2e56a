"""Which GEMMs autocast runs in a float8 or block format: those against a weight.

Each function below is counted by the precision audit, which reads the lowered program
(not the rule): the float8 GEMMs under per-tensor scaling, the block-scaled ones by format.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

FORMATS = ("current", "mxfp8", "nvfp4")


def _in_format(fun, fmt, *args):
    report = jaxamp.precision_report(jaxamp.autocast(fun, f"p=f32,c=f32,fp8={fmt}"))(*args)
    return report.block_gemms().get(fmt, 0) if fmt != "current" else report.float8_gemms()[0]


def _normal(i, shape):
    return jax.random.normal(jax.random.key(i), shape)


X, WQ, WK, WV = (_normal(i, (32, 32)) for i in range(4))


def _attention(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv
    return jax.nn.softmax(q @ k.T / 4.0) @ v


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_written_by_hand_runs_its_projections_in_the_format_alone(fmt):
    assert _in_format(_attention, fmt, X, WQ, WK, WV) == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_gemm_of_two_arguments_or_of_a_computed_kernel_is_against_a_weight(fmt):
    """An argument is a weight whatever it holds; a kernel computed from weights alone (a
    normalised one, a weight slice a loop counter picks) is one too."""
    assert _in_format(lambda a, b: a @ b, fmt, X, WQ) == 1
    assert _in_format(lambda x, w: x @ (w / jnp.linalg.norm(w, axis=0)), fmt, X, WQ) == 1
    ws = jnp.stack([WQ, WK, WV])

    def layers(x, ws):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ ws[i]), x)

    assert _in_format(layers, fmt, X, ws) == 1  # one GEMM in the loop's body


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tied_head_stays_out_of_the_format(fmt):
    """The table the function looks rows up in is an embedding table: its GEMM (the tied
    head's logits) stays in the compute dtype, as the policies keep ``Embed.attend``; the
    same GEMM against a table never looked up is against a weight."""
    ids = jnp.arange(32) % 7

    def tied(table, w, ids):
        h = jnp.tanh(jnp.take(table, ids, axis=0) @ w)
        return h @ table.T

    assert _in_format(tied, fmt, X, WQ, ids) == 1  # h @ w alone
    assert _in_format(lambda table, w, x: jnp.tanh(x @ w) @ table.T, fmt, WK, WQ, X) == 2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wrap", ["checkpoint", "scan", "cond"])
def test_bodies_keep_the_kinds_of_the_values_they_are_entered_with(fmt, wrap):
    """Attention inside a checkpoint, a scan over layers and a cond's branch: the
    projections in the format, the two matmuls of activations not."""
    if wrap == "checkpoint":
        fun = jax.checkpoint(_attention)
        args = (X, WQ, WK, WV)
    elif wrap == "scan":

        def fun(x, ws):
            def layer(h, w):
                return h + _attention(h, w[0], w[1], w[2]), None

            return jax.lax.scan(layer, x, ws)[0]

        args = (X, jnp.stack([jnp.stack([WQ, WK, WV])] * 2))
    else:

        def fun(x, wq, wk, wv, pred):
            return jax.lax.cond(pred, _attention, lambda *a: a[0], x, wq, wk, wv)

        args = (X, WQ, WK, WV, True)
    assert _in_format(fun, fmt, *args) == 3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wrap", ["checkpoint", "cond", "scan"])
def test_a_table_looked_up_inside_a_body_is_a_table_outside_it(fmt, wrap):
    """The lookup under ``remat`` (``nn.remat`` around an embedder), in a branch or in a
    loop's body marks the table the function was given, so the tied head after it stays
    out of the format."""
    ids = jnp.arange(32) % 7

    def lookup(table, ids):
        if wrap == "checkpoint":
            return jax.checkpoint(lambda t, i: jnp.take(t, i, axis=0))(table, ids)
        if wrap == "cond":
            return jax.lax.cond(
                True, lambda t, i: jnp.take(t, i, axis=0), lambda t, i: t, table, ids
            )
        return jax.lax.scan(lambda c, i: (c, jnp.take(table, i, axis=0)), 0.0, ids)[1]

    def tied(table, w, ids):
        return jnp.tanh(lookup(table, ids) @ w) @ table.T

    assert _in_format(tied, fmt, X, WQ, ids) == 1  # the GEMM against w alone


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_weight_written_on_the_left_is_quantized_as_on_the_right(fmt):
    """NVFP4 tiles a layer's kernel 16 x 16, MXFP8 blocks it along the contraction: a
    weight on the left (``(W.T @ h.T).T``) is quantized as the same weight on the right,
    so the two spellings give the same bits, outputs and gradients."""
    w, wh = _normal(4, (64, 48)), _normal(5, (64, 64))
    x = _normal(6, (40, 64)) * jnp.logspace(-2, 2, 40)[:, None]
    policy = f"p=f32,c=f32,fp8={fmt}"
    right = jaxamp.autocast(lambda w, wh: jnp.sum(jnp.tanh(jnp.tanh(x @ wh) @ w) ** 2), policy)
    left = jaxamp.autocast(
        lambda w, wh: jnp.sum(jnp.tanh((w.T @ jnp.tanh(x @ wh).T).T) ** 2), policy
    )
    for a, b in zip(
        jax.jit(jax.value_and_grad(right, (0, 1)))(w, wh),
        jax.jit(jax.value_and_grad(left, (0, 1)))(w, wh),
        strict=True,
    ):
        jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_weight_a_body_passes_through_stays_a_weight(fmt):
    """A checkpointed layer that returns its weight with its output (``nnx.remat`` of a
    function of the module does), and a loop carrying a weight through a jitted layer:
    the weight comes out a weight, and its next GEMM runs in the format."""

    def layer(h, w):
        return jnp.tanh(h @ w), w

    def remat(x, w):
        h, w = jax.checkpoint(layer)(x, w)
        return h @ w

    def loop(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, c: jax.jit(layer)(*c), (x, w))[0]

    assert _in_format(remat, fmt, X, WQ) == 2
    assert _in_format(loop, fmt, X, WQ) == 1  # one GEMM in the loop's body


def test_nnx_remat_of_a_function_of_the_module_keeps_the_next_layer_in_the_format():
    class Model(nnx.Module):
        def __init__(self):
            self.first = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
            self.second = nnx.Linear(32, 32, rngs=nnx.Rngs(1))

        def __call__(self, x):
            x = nnx.remat(lambda m, x: jnp.tanh(m.first(x)))(self, x)
            return self.second(x)

    graph, state = nnx.split(Model())
    policy = "p=f32,c=f32,fp8=mxfp8"
    call = jaxamp.autocast(lambda s, x: nnx.merge(graph, s)(x), policy)
    assert jaxamp.precision_report(call)(state, X).block_gemms() == {"mxfp8": 2}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_read_by_index_and_a_padded_vocabulary_head_make_a_table(fmt):
    """``table[token]`` (a ``dynamic_slice``, as sampling one token writes it) is a lookup
    as ``jnp.take`` is, and a head against ``table[:n]`` (a padded vocabulary's real
    rows) is against that table: both keep the tied head out of the format, while a
    stack of weights sliced by a loop counter stays a weight (above)."""
    tokens = jnp.arange(4)

    def one_token(table, w, tokens):
        return jnp.tanh(table[tokens[0]][None] @ w) @ table.T

    def padded(table, w, tokens):
        return jnp.tanh(jnp.take(table, tokens, axis=0) @ w) @ table[:24].T

    assert _in_format(one_token, fmt, X, WQ, tokens) == 1  # the GEMM against w alone
    assert _in_format(padded, fmt, X, WQ, tokens) == 1  # the GEMM against w alone
