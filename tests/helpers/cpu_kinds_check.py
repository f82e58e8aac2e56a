"""The paths a CPU without bf16 units takes, checked on one: a script, not a test module.

XLA:CPU picks its kernels from the CPU it runs on (CPUID), not from /proc/cpuinfo, so
the only way to run a CPU without bf16 units on a machine that has them is to emulate
one. QEMU's user-mode ``-cpu max`` is an x86-64 with AVX2 and FMA and no AVX-512 (the
kind of AMD EPYC whose flags list ``avx avx2 fma f16c`` and no ``avx512_bf16``)::

  qemu-x86_64 -cpu max .venv/bin/python tests/helpers/cpu_kinds_check.py

It is about 50 times slower than the host: the models are tiny. Each check prints one
JSON line; the script exits non-zero if any fails.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from jaxamp._src.ops.matmul import DotGeneral
from jaxamp.models import BertClassifier, BertConfig, GPT2Config, GPT2LMHeadModel

IDS = jax.random.randint(jax.random.key(0), (2, 16), 1, 64)


def attention_einsum_gradient():
    """The smallest case that failed at run time with the old CPU form."""
    a = jax.random.normal(jax.random.key(1), (2, 2, 8, 8)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (2, 8, 2, 16)).astype(jnp.bfloat16)
    rule = DotGeneral(jnp.bfloat16)
    loss = lambda a, b: rule.einsum("...hqk,...khd->...qhd", a, b).astype(jnp.float32).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    return {"finite": bool(all(jnp.isfinite(g).all() for g in grads))}


def _train(module, policy, targets, loss_of_logits, steps=2):
    params = module.init(jax.random.key(0), IDS)["params"]
    model = jaxamp.linen.apply_policy(module, policy)

    def loss(params):
        return loss_of_logits(model.apply({"params": params}, IDS).astype(jnp.float32), targets)

    tx = jaxamp.loss_scaled(optax.adam(1e-3)) if policy != "float32" else optax.adam(1e-3)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        if policy != "float32":
            value, grads = jaxamp.value_and_grad(loss)(params, opt_state=state)
        else:
            value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(steps):
        params, state, value = step(params, state)
        losses.append(float(value))
    return losses


def _classify(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _next_token(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def _models():
    bert = BertConfig(
        vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
        max_position=16, num_classes=3,
    )  # fmt: skip
    gpt2 = GPT2Config(vocab_size=64, max_position=16, hidden_size=32, num_layers=1, num_heads=2)
    return {
        "jaxamp BERT": (BertClassifier(bert), jnp.arange(2) % 3, _classify),
        "jaxamp GPT-2": (GPT2LMHeadModel(gpt2), IDS, _next_token),
    }


def train(name, policy):
    module, targets, loss_of_logits = _models()[name]
    ours = _train(module, policy, targets, loss_of_logits)
    reference = _train(module, "float32", targets, loss_of_logits)
    close = bool(np.allclose(ours, reference, rtol=0.02))
    return {"losses": ours, "float32": reference, "within_2_percent": close}


def forward_mode():
    module, _, _ = _models()["jaxamp BERT"]
    model = jaxamp.linen.apply_policy(module, "mixed_bfloat16")
    params = model.init(jax.random.key(0), IDS)["params"]
    tangent = jax.tree.map(jnp.ones_like, params)
    f = lambda p: model.apply({"params": p}, IDS).astype(jnp.float32).sum()
    _, dy = jax.jit(lambda p, t: jax.jvp(f, (p,), (t,)))(params, tangent)
    return {"finite": bool(jnp.isfinite(dy))}


CHECKS = {
    "attention einsum gradient (bf16)": attention_einsum_gradient,
    "jaxamp BERT, mixed_bfloat16": lambda: train("jaxamp BERT", "mixed_bfloat16"),
    "jaxamp BERT, mixed_float16": lambda: train("jaxamp BERT", "mixed_float16"),
    "jaxamp GPT-2, mixed_bfloat16": lambda: train("jaxamp GPT-2", "mixed_bfloat16"),
    "jax.jvp through a policy model": forward_mode,
}


def main() -> int:
    failed = 0
    for name, check in CHECKS.items():
        start = time.perf_counter()
        record = {"check": name, "matmul_form": jaxamp.ops.matmul_form().name}
        try:
            record.update(check())
            ok = all(v for k, v in record.items() if isinstance(v, bool))
        except Exception as e:  # report and go on: every check is worth its line
            record["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
            ok = False
        record["ok"], record["seconds"] = ok, round(time.perf_counter() - start, 1)
        failed += not ok
        print(json.dumps(record), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
