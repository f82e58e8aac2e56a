"""Each autocast call carries its own context: other threads and imports change nothing."""

import dataclasses
import json
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers.promotion import SUBJECT


class _Meeting:
    """Makes threads' calls run at once: ``meet(x)`` (the identity, with a custom JVP)
    waits for the other threads each of the first ``limit`` times a thread traces it:
    once in autocast's trace of the function, and once more, for its JVP rule, in
    autocast's evaluation of the program under ``jax.grad`` (where ``x`` is
    differentiated). Between two meetings in the evaluation, before and after a GEMM,
    every thread is evaluating its own program. Alone (no barrier) it only counts."""

    def __init__(self):
        self.barrier = None
        self.limit = 0
        self.local = threading.local()

    def wait(self):
        count = getattr(self.local, "count", 0)
        self.local.count = count + 1
        if self.barrier is not None and count < self.limit:
            self.barrier.wait()

    def meet(self):
        @jax.custom_jvp
        def meet(x):
            self.wait()
            return x

        @meet.defjvp
        def meet_jvp(primals, tangents):
            self.wait()
            return primals[0], tangents[0]

        return meet


def _delayed_float8(meet):
    """``sum((x @ w)**2)`` under delayed float8 scaling: the loss, its gradient and the
    next state, from a state one step old (a history of its own)."""

    def square(w, x):  # meets before the GEMM and after it, in the evaluation too
        side = jnp.sum(meet(w))
        return jnp.sum(meet(x @ w) ** 2) + side

    f = jaxamp.autocast(square, "mixed_float8_delayed")
    w = jnp.linspace(-1.0, 1.0, 32 * 16).reshape(32, 16)
    x = jnp.cos(jnp.arange(8 * 32, dtype=jnp.float32)).reshape(8, 32) * 3.0

    def loss(w, state):
        return f(w, x, fp8_state=state)

    state = jaxamp.init_fp8_state(f, w, x)
    _, (_, state) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, state)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (w, state)


def _other_delayed_float8(meet):
    """A two-layer network under another delayed float8 policy (a shorter history), whose
    GEMMs have other names (``args[1] @ args[0]['w1']``, ``· @ args[0]['w2']``)."""
    base = jaxamp.get_policy("mixed_float8_delayed")
    policy = dataclasses.replace(base, fp8=jaxamp.Fp8Recipe("delayed", amax_history_length=16))

    def net(p, x):
        side = jnp.sum(meet(p["w2"]))
        return jnp.sum(meet(jnp.tanh(x @ p["w1"]) @ p["w2"])) + side

    f = jaxamp.autocast(net, policy)
    params = {
        "w1": jnp.sin(jnp.arange(16 * 24, dtype=jnp.float32)).reshape(16, 24),
        "w2": jnp.linspace(-2.0, 2.0, 24 * 4).reshape(24, 4),
    }
    x = jnp.linspace(-5.0, 5.0, 4 * 16).reshape(4, 16)

    def loss(params, state):
        return f(params, x, fp8_state=state)

    state = jaxamp.init_fp8_state(f, params, x)
    _, (_, state) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, state)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, state)


_BIAS = jnp.where(jnp.arange(8) % 3 == 0, 0.0, -1e9)  # a float32 mask bias, closed over


def _masked_float16(meet):
    """Attention-like scores of float16 values under ``mixed_float16``: a mask written as
    ``where(mask, 0.0, -1e9)`` on them (kept in float32, not rounded to ``-inf``) and a
    closed-over float32 bias of ``-1e9``."""

    def scores(w, x, mask):
        side = jnp.sum(meet(w)).astype(jnp.float32)
        logits = (x @ w + jnp.where(mask, 0.0, -1e9)).astype(jnp.float32) + _BIAS
        return jnp.sum(jax.nn.softmax(meet(logits)) * jnp.arange(8.0)) + side

    f = jaxamp.autocast(scores, "mixed_float16")
    w = jnp.linspace(-1.0, 1.0, 16 * 8, dtype=jnp.float16).reshape(16, 8)
    x = jnp.sin(jnp.arange(4 * 16, dtype=jnp.float32)).reshape(4, 16).astype(jnp.float16)
    mask = jnp.arange(8) % 2 == 0
    return jax.jit(jax.value_and_grad(lambda w: f(w, x, mask))), (w,)


def _alone(make):
    """``make``'s job run alone in this thread: ``(result, times it met)``."""
    meeting = _Meeting()
    step, args = make(meeting.meet())
    meeting.local.count = 0
    result = jax.device_get(step(*args))
    return result, meeting.local.count


def _together(makes, limit):
    """The jobs of ``makes`` run at once, one thread each, meeting ``limit`` times."""
    meetings = [_Meeting() for _ in makes]
    jobs = [make(m.meet()) for make, m in zip(makes, meetings, strict=True)]
    barrier = threading.Barrier(len(makes), timeout=120)
    for meeting in meetings:
        meeting.barrier, meeting.limit = barrier, limit
    results, errors = [None] * len(jobs), []

    def run(i):
        step, args = jobs[i]
        try:
            results[i] = jax.device_get(step(*args))
        except BaseException as e:  # raised below; the others stop waiting for this one
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _assert_bit_for_bit(alone, together):
    leaves, tree = jax.tree.flatten(alone)
    other_leaves, other_tree = jax.tree.flatten(together)
    assert tree == other_tree
    for a, b in zip(leaves, other_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.standard_promotion(SUBJECT)
def test_threads_autocasting_at_once_each_get_their_own_result():
    """Three threads autocast three functions under three policies at once, their traces
    and their evaluations overlapping: two under delayed float8 scaling, each with its
    own state, and one in float16 whose -1e9 mask and closed-over bias must not become
    -inf. Each gets, bit for bit, what it gets alone."""
    makes = (_delayed_float8, _other_delayed_float8, _masked_float16)
    alone, counts = zip(*map(_alone, makes), strict=True)
    assert min(counts) >= 4, counts  # traced twice and evaluated twice: the meetings happen
    loss, grad = alone[2]
    assert np.isfinite(loss) and np.all(np.isfinite(grad)) and np.any(grad != 0)
    together = _together(makes, min(counts))
    for one, other in zip(alone, together, strict=True):
        _assert_bit_for_bit(one, other)


_PROGRAM = """
import importlib.util, json, sys, types

if sys.argv[1] == "without":  # jaxamp/__init__.py imports the Flax policies: skip it
    spec = importlib.util.find_spec("jaxamp")
    package = types.ModuleType("jaxamp")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["jaxamp"] = package
    from jaxamp._src.autocast.api import autocast
else:
    import jaxamp.linen, jaxamp.nnx
    from jaxamp import autocast

import jax, jax.numpy as jnp, numpy as np
from jax import lax

bias = jnp.where(jnp.arange(8) % 3 == 0, 0.0, -1e9)


def f(params, x, mask):
    h = x @ params["w"]
    h = h + jnp.where(mask, 0.0, -1e9) + 1e5 * params["gate"]
    h = lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ params["u"]) + h, h)
    return jnp.sum(jax.nn.log_softmax(h.astype(jnp.float32) + bias) ** 2)


params = {
    "w": jnp.linspace(-1, 1, 64, dtype=jnp.float16).reshape(8, 8),
    "u": jnp.eye(8, dtype=jnp.float16) * 0.5,
    "gate": jnp.zeros((), jnp.float16),
}
x = jnp.sin(jnp.arange(32.0)).reshape(4, 8).astype(jnp.float16)
mask = jnp.arange(8) % 2 == 0
found = {"flax": "flax" in sys.modules}
for policy in ("mixed_float16", "mixed_bfloat16", "mixed_float8"):
    step = jax.jit(jax.value_and_grad(autocast(f, policy)))
    found[policy] = [
        step.lower(params, x, mask).as_text(),
        [np.asarray(v).tobytes().hex() for v in jax.tree.leaves(step(params, x, mask))],
    ]
print(json.dumps(found))
"""


def _autocast_in_a_fresh_process(flax):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PROGRAM), "with" if flax else "without"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_flax_or_its_policies_changes_nothing():
    """A function that does not use Flax, autocast in a fresh process where Flax was never
    imported and in one that imported jaxamp.linen and jaxamp.nnx first, is the same
    program (its lowered text) with the same results, bit for bit, under three
    policies: what a call needs is passed to it, not plugged in by an import."""
    without, with_flax = map(_autocast_in_a_fresh_process, (False, True))
    assert not without.pop("flax") and with_flax.pop("flax")
    assert without == with_flax
