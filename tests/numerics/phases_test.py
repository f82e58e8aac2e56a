"""Tests for jaxamp/_src/numerics/phases.py: forward or backward, inside loops too."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp


def _layer_norm(h):
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-12)


def _norm_loss(wrap):
    def loss(w, x):
        def step(h):
            with jax.named_scope("norm"):
                return _layer_norm(h @ w)

        h = wrap(step, x)
        return jnp.mean(h[:, :2] ** 3)

    return loss


def _unrolled(step, x):
    return step(step(x))


def _scanned(step, x):
    return jax.lax.scan(lambda h, _: (step(h), None), x, None, length=2)[0]


def _remat(step, x):
    return jax.checkpoint(step)(jax.checkpoint(step)(x))


def _cond(step, x):
    both = lambda h: step(step(h))
    return jax.lax.cond(jnp.sum(x) > -1e9, both, lambda h: h * 2.0, x)


def _norm_inputs():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jnp.full((8, 8), 1e-3) + 1e-5 * jax.random.normal(jax.random.key(1), (8, 8))
    return w, x


@pytest.mark.parametrize("wrap", [_scanned, _remat, _cond], ids=["scan", "remat", "cond"])
def test_range_report_phases_inside_loops_match_the_unrolled_program(wrap):
    """A near-constant row's LayerNorm has a derivative of ~1e13: a value of the
    gradient, not an activation, inside a scan, remat or cond as outside it."""
    w, x = _norm_inputs()
    plain = jaxamp.range_report(jax.jit(_norm_loss(_unrolled)))(w, x)
    looped = jaxamp.range_report(jax.jit(_norm_loss(wrap)))(w, x)
    fwd = lambda r: next(row for row in r.layers if row.layer == "norm" and row.phase == "forward")
    assert fwd(plain).max_abs < 65504, plain.table()  # the activations fit float16
    assert fwd(looped).max_abs == pytest.approx(fwd(plain).max_abs, rel=1e-5), looped.table()
    assert ("norm", "forward") not in {(r.layer, r.phase) for r in looped.overflows()}
    assert ("norm", "backward") in {(r.layer, r.phase) for r in looped.overflows()}
    assert looped.recommend().reason.startswith("Use bfloat16: gradients")


def test_a_derivative_computed_inside_a_scan_is_a_backward_fault():
    def loss(w, x):
        def body(h, _):
            with jax.named_scope("root"):
                return jnp.sqrt(h * w), None

        return jnp.sum(jax.lax.scan(body, x, None, length=2)[0])

    fault = jaxamp.find_nonfinite(jax.jit(loss))(jnp.float32(1.0), jnp.array([1.0, 0.0]))
    # 0.5 / sqrt(0), which the forward scan computes for the backward one
    assert (fault.phase, fault.primitive, fault.layer) == ("backward", "div", "root"), fault
    assert fault.iteration == (0,)


def test_a_while_loop_of_the_forward_pass_counts_as_forward():
    def loss(w, x):
        with jax.named_scope("loop"):
            n = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 3.0), (0, x))
        return jnp.sum(jax.lax.stop_gradient(n[1]) * w)

    report = jaxamp.range_report(jax.jit(loss))(jnp.ones(3), jnp.full(3, 1e4))
    loop = [r for r in report.layers if r.layer == "loop"]
    assert [r.phase for r in loop] == ["forward"] and loop[0].max_abs == 2.7e5
