"""Tests for jaxamp/_src/flax_policy/linen.py on unmodified Linen models (ResNet and BERT)."""

import collections
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxamp
from jaxamp.models import BasicBlock, BertClassifier, ResNet
from tests.helpers.promotion import FLAX, SUBJECT
from tests.helpers.tiny_configs import TINY_BERT

DTYPES = {"float32": jnp.float32, "mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}


def tiny_resnet():
    return ResNet((1, 1), BasicBlock, num_classes=5, width=8)


@pytest.fixture(scope="module")
def images():
    return jax.random.normal(jax.random.key(1), (4, 16, 16, 3))


@pytest.fixture(scope="module")
def tokens():
    ids = jax.random.randint(jax.random.key(2), (4, 8), 1, 64)
    return ids.at[:, -2:].set(0)  # padding


def resnet_loss(model, images):
    def loss(params, batch_stats):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
        )
        return jnp.mean(logits.astype(jnp.float32) ** 2), (logits, updates)

    return loss


def bert_loss(model, tokens):
    def loss(params):
        logits = model.apply({"params": params}, tokens, attention_mask=(tokens > 0))
        return jnp.mean(logits.astype(jnp.float32) ** 2), logits

    return loss


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", list(DTYPES))
def test_resnet_dtypes(name, images):
    model = jaxamp.linen.apply_policy(tiny_resnet(), name)
    variables = jax.jit(model.init)(jax.random.key(0), images)
    assert {x.dtype for x in jax.tree.leaves(variables["params"])} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(variables["batch_stats"])} == {np.dtype("float32")}

    loss = jax.jit(jax.value_and_grad(resnet_loss(model, images), has_aux=True))
    (_, (logits, updates)), grads = loss(variables["params"], variables["batch_stats"])
    assert logits.dtype == jnp.float32  # output_dtype
    assert {x.dtype for x in jax.tree.leaves(grads)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(updates)} == {np.dtype("float32")}

    report = jaxamp.precision_report(jax.grad(resnet_loss(model, images), has_aux=True))(
        variables["params"], variables["batch_stats"]
    )
    report.check(DTYPES[name])
    assert report.count(kind="convolution") > 0 and report.count(kind="dot_general") > 0
    assert report.all_operands_in(DTYPES[name]), report
    assert {op.direction for op in report.ops} == {"forward", "backward"}


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", list(DTYPES))
def test_bert_dtypes(name, tokens):
    model = jaxamp.linen.apply_policy(BertClassifier(TINY_BERT), name)
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    assert {x.dtype for x in jax.tree.leaves(variables)} == {np.dtype("float32")}
    (_, logits), grads = jax.jit(jax.value_and_grad(bert_loss(model, tokens), has_aux=True))(
        variables["params"]
    )
    assert logits.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(grads)} == {np.dtype("float32")}
    report = jaxamp.precision_report(jax.grad(bert_loss(model, tokens), has_aux=True))(
        variables["params"]
    )
    report.check(DTYPES[name])
    # q, k, v, out projections + two attention matmuls + two FFN layers per layer, forward.
    forward = [op for op in report.ops if op.direction == "forward"]
    assert len(forward) >= 2 * 8 + 2
    assert report.all_operands_in(DTYPES[name]), report


def test_float32_policy_has_no_16_bit_matmuls(images):
    model = jaxamp.linen.apply_policy(tiny_resnet(), "float32")
    variables = jax.jit(model.init)(jax.random.key(0), images)
    report = jaxamp.precision_report(jax.grad(resnet_loss(model, images), has_aux=True))(
        variables["params"], variables["batch_stats"]
    )
    assert report.all_operands_in("float32")
    assert report.count("bfloat16") == report.count("float16") == 0
    report.check(jnp.float32)


@pytest.mark.standard_promotion(FLAX)
def test_activations_are_in_compute_dtype(images, tokens):
    model = jaxamp.linen.apply_policy(tiny_resnet(), "mixed_bfloat16")
    variables = jax.jit(model.init)(jax.random.key(0), images)
    out, state = jax.jit(
        lambda v: model.apply(
            v, images, capture_intermediates=True, mutable=["intermediates", "batch_stats"]
        )
    )(variables)
    dtypes = {"/".join(path): leaf.dtype for path, leaf in _flat(state["intermediates"])}
    convs = [v for k, v in dtypes.items() if "Conv" in k]
    norms = [v for k, v in dtypes.items() if "BatchNorm" in k]
    assert convs and set(convs) == {np.dtype(jnp.bfloat16)}
    assert norms and set(norms) == {np.dtype(jnp.bfloat16)}
    assert dtypes["__call__"] == jnp.bfloat16  # the head computes in bfloat16...
    assert out.dtype == jnp.float32  # ...and the output comes back in output_dtype

    bert = jaxamp.linen.apply_policy(BertClassifier(TINY_BERT), "mixed_bfloat16")
    variables = jax.jit(bert.init)(jax.random.key(0), tokens)
    _, state = jax.jit(
        lambda v: bert.apply(v, tokens, capture_intermediates=True, mutable=["intermediates"])
    )(variables)
    dtypes = {"/".join(p): leaf.dtype for p, leaf in _flat(state["intermediates"])}
    for name in ("word", "embeddings_norm", "layer_0/attention", "layer_0/output_norm"):
        assert dtypes[f"{name}/__call__"] == jnp.bfloat16, name


def _flat(tree):
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        out.append((keys[:-1], leaf))  # drop the tuple index sow adds
    return out


@pytest.mark.standard_promotion(FLAX)
def test_softmax_and_norm_statistics_are_float32(tokens):
    """Softmax runs on float32 values; LayerNorm statistics are float32 reductions."""
    model = jaxamp.linen.apply_policy(BertClassifier(TINY_BERT), "mixed_bfloat16")
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(variables["params"])
    sensitive = [
        e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name in ("reduce_max", "reduce_sum", "exp")
    ]
    counts = collections.Counter(e.primitive.name for e in sensitive)
    # two layers: a softmax each (max, exp, sum), LayerNorm statistics (sums), the pooler
    assert counts["exp"] >= 2 and counts["reduce_max"] >= 2 and counts["reduce_sum"] >= 6, counts
    for eqn in sensitive:
        assert eqn.invars[0].aval.dtype == jnp.float32, eqn


def _all_eqns(jaxpr):
    """Every equation, those of sub-jaxprs (remat, jit, custom_jvp, cond branches) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


@pytest.mark.standard_promotion(FLAX)
def test_integer_inputs_are_never_cast(tokens):
    model = jaxamp.linen.apply_policy(BertClassifier(TINY_BERT), "bfloat16")
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    assert variables["params"]["word"]["embedding"].dtype == jnp.bfloat16  # pure bf16 params
    seen = []

    def spy(next_fun, args, kwargs, context):
        if context.module.name == "word" and context.method_name == "__call__":
            seen.append(args[0].dtype)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        jax.jit(model.apply)(variables, tokens)
    assert seen == [jnp.int32]


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", list(DTYPES))
def test_close_to_float32_model(name, images, tokens):
    tol = {"float32": 1e-5, "mixed_bfloat16": 5e-2, "mixed_float16": 1e-2}[name]
    plain = tiny_resnet()
    variables = jax.jit(plain.init)(jax.random.key(0), images)
    run = lambda m: jax.jit(lambda v: m.apply(v, images, mutable=["batch_stats"]))
    reference = run(plain)(variables)[0]
    out = run(jaxamp.linen.apply_policy(plain, name))(variables)
    np.testing.assert_allclose(out[0], reference, atol=tol, rtol=tol)

    bert = BertClassifier(TINY_BERT)
    variables = jax.jit(bert.init)(jax.random.key(0), tokens)
    run = lambda m: jax.jit(lambda v, t: m.apply(v, t, attention_mask=t > 0))
    reference = run(bert)(variables, tokens)
    out = run(jaxamp.linen.apply_policy(bert, name))(variables, tokens)
    np.testing.assert_allclose(out, reference, atol=tol, rtol=tol)


@pytest.mark.standard_promotion(FLAX)
def test_gradients_close_to_float32_model(images):
    plain = tiny_resnet()
    variables = jax.jit(plain.init)(jax.random.key(0), images)
    ref = jax.jit(jax.grad(resnet_loss(plain, images), has_aux=True))(
        variables["params"], variables["batch_stats"]
    )
    mixed = jaxamp.linen.apply_policy(plain, "mixed_bfloat16")
    got = jax.jit(jax.grad(resnet_loss(mixed, images), has_aux=True))(
        variables["params"], variables["batch_stats"]
    )
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        r, g = np.asarray(r), np.asarray(g)
        scale = float(np.max(np.abs(r))) + 1e-6
        assert float(np.max(np.abs(r - g))) / scale < 0.1


@pytest.mark.standard_promotion(FLAX)
def test_step_compiles_once(images):
    model = jaxamp.linen.apply_policy(tiny_resnet(), "mixed_bfloat16")
    variables = jax.jit(model.init)(jax.random.key(0), images)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1)
    )
    traces = []

    @jax.jit
    def step(state, batch_stats, images):
        traces.append(1)
        (loss, (_, updates)), grads = jax.value_and_grad(
            lambda p: resnet_loss_apply(state.apply_fn, p, batch_stats, images), has_aux=True
        )(state.params)
        return state.apply_gradients(grads=grads), updates["batch_stats"], loss

    batch_stats = variables["batch_stats"]
    losses = []
    for _ in range(3):
        state, batch_stats, loss = step(state, batch_stats, images)
        losses.append(float(loss))
    assert len(traces) == 1
    assert losses[-1] < losses[0]


def resnet_loss_apply(apply_fn, params, batch_stats, images):
    logits, updates = apply_fn(
        {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
    )
    return jnp.mean(logits.astype(jnp.float32) ** 2), (logits, updates)


@pytest.mark.standard_promotion(FLAX)
def test_overrides_by_path_and_class(images):
    model = jaxamp.linen.apply_policy(tiny_resnet(), "mixed_bfloat16", overrides={"fc": "float32"})
    variables = jax.jit(model.init)(jax.random.key(0), images)
    report = jaxamp.precision_report(lambda v: model.apply(v, images, mutable=["batch_stats"]))(
        variables
    )
    assert report.by_dtype() == {"bfloat16": report.count(kind="convolution"), "float32": 1}

    model = jaxamp.linen.apply_policy(
        tiny_resnet(), "mixed_bfloat16", overrides={nn.Dense: "float32"}
    )
    report = jaxamp.precision_report(lambda v: model.apply(v, images, mutable=["batch_stats"]))(
        variables
    )
    assert report.count("float32", kind="dot_general") == 1

    # A class override covers the subtree: every conv inside BasicBlock stays float32.
    model = jaxamp.linen.apply_policy(
        tiny_resnet(), "mixed_bfloat16", overrides={BasicBlock: "f32"}
    )
    report = jaxamp.precision_report(lambda v: model.apply(v, images, mutable=["batch_stats"]))(
        variables
    )
    assert report.count("bfloat16") == 2  # conv1 and fc
    assert report.count("float32", kind="convolution") >= 4


class BodyAndHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.Dense(4, name="body")(x))


@pytest.mark.parametrize("root", ["p=bf16,c=bf16,o=f32", "p=f16,c=f16,o=f32"])
def test_an_overridden_layer_computes_with_its_own_param_dtype(root):
    """Under a 16-bit param root, a float32 head keeps its float32 weights at apply time."""
    model = jaxamp.linen.apply_policy(BodyAndHead(), root, overrides={"head": "float32"})
    x = jax.random.normal(jax.random.key(0), (2, 5))
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    sixteen = model.policy.param_dtype
    assert {p.dtype for p in jax.tree.leaves(params["body"])} == {sixteen}
    assert {p.dtype for p in jax.tree.leaves(params["head"])} == {np.dtype("float32")}
    # a head kernel that 16 bits cannot hold: 1 + 2**-12 rounds to 1 in bf16 and f16
    params["head"]["kernel"] = jnp.full((4, 3), 1 + 2**-12, jnp.float32)
    out = jax.jit(lambda p: model.apply({"params": p}, x))(params)
    body = jaxamp.linen.apply_policy(nn.Dense(4), root)  # its 16-bit output, exactly, in f32
    hidden = body.apply({"params": params["body"]}, x)
    expected = hidden @ params["head"]["kernel"] + params["head"]["bias"]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, x).sum()))(params)
    assert grads["head"]["kernel"].dtype == jnp.float32


class TiedHead(nn.Module):
    """A language model whose head reuses the embedding, as transformers' tied heads do."""

    tied: bool = True

    def setup(self):
        self.embed = nn.Embed(50, 16)
        self.body = nn.Dense(16)
        self.lm_head = nn.Dense(50, use_bias=False)

    def __call__(self, ids):
        h = self.body(self.embed(ids))
        if self.tied:  # the head rooted in a scope of its own by Module.apply
            return self.lm_head.apply({"params": {"kernel": self.embed.embedding.T}}, h)
        return self.lm_head(h)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("key", ["lm_head", nn.Dense])
def test_an_override_reaches_a_layer_called_through_module_apply(tied, key):
    model = jaxamp.linen.apply_policy(TiedHead(tied), "mixed_bfloat16", overrides={key: "float32"})
    ids = jnp.arange(8).reshape(2, 4)
    variables = jax.jit(model.init)(jax.random.key(0), ids)
    for fn in (lambda v: model.apply(v, ids), jax.grad(lambda v: model.apply(v, ids).sum())):
        head = [op for op in jaxamp.precision_report(fn)(variables).ops if "lm_head" in op.name]
        assert head and {op.lhs_dtype for op in head} == {"float32"}, head


@pytest.mark.parametrize("key", ["lm_hed", "encoder/*", nn.Conv])
def test_an_override_that_matches_no_layer_warns(key):
    model = jaxamp.linen.apply_policy(TiedHead(), "mixed_bfloat16", overrides={key: "float32"})
    ids = jnp.arange(8).reshape(2, 4)
    name = key.__name__ if isinstance(key, type) else repr(key)
    with pytest.warns(UserWarning, match=re.escape(name) + ".*'body', 'embed', 'lm_head'"):
        variables = jax.jit(model.init)(jax.random.key(0), ids)
    with pytest.warns(UserWarning, match=re.escape(name)):
        jax.jit(model.apply)(variables, ids)


def test_an_override_that_matches_a_layer_does_not_warn(recwarn):
    overrides = {"lm_head": "float32", nn.Embed: "float32", "bo*": "float32"}
    model = jaxamp.linen.apply_policy(TiedHead(), "mixed_bfloat16", overrides=overrides)
    ids = jnp.arange(8).reshape(2, 4)
    jax.jit(model.apply)(jax.jit(model.init)(jax.random.key(0), ids), ids)
    assert not [w for w in recwarn if "override" in str(w.message)]


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"jaxamp\.nnx\.apply_policy"):
        jaxamp.linen.apply_policy(object(), "float32")
    with pytest.raises(TypeError, match=r"got str: 'mixed_bfloat16'"):  # arguments swapped
        jaxamp.linen.apply_policy("mixed_bfloat16", tiny_resnet())
    with pytest.raises(TypeError, match=r"AutocastRules, got str: 'strict'"):
        jaxamp.linen.apply_policy(tiny_resnet(), "float32", rules="strict")
    with pytest.raises(ValueError, match="Valid choices"):
        jaxamp.linen.apply_policy(tiny_resnet(), "mixed_bf16")
    with pytest.raises(TypeError, match="override key"):
        jaxamp.linen.apply_policy(tiny_resnet(), "float32", overrides={3: "float32"})
    with pytest.raises(ValueError, match="residuals"):
        jaxamp.linen.apply_policy(tiny_resnet(), "float32", residuals="some")


@pytest.mark.standard_promotion(FLAX)
def test_wrapper_behaves_like_the_module(tokens):
    model = jaxamp.linen.apply_policy(BertClassifier(TINY_BERT), "mixed_bfloat16")
    assert model.config is TINY_BERT
    assert "mixed" not in repr(model) and "bfloat16" in repr(model)
    out, variables = jax.jit(model.init_with_output)(jax.random.key(0), tokens)
    assert out.dtype == jnp.float32
    # Same variable structure as the unmodified module.
    plain = jax.jit(BertClassifier(TINY_BERT).init)(jax.random.key(0), tokens)
    assert jax.tree.structure(plain) == jax.tree.structure(variables)


def test_auto_policy_default(images):
    model = jaxamp.linen.apply_policy(tiny_resnet())
    assert model.policy == jaxamp.auto_policy()


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("kind", ["resnet", "bert"])
def test_converts_are_hand_written_dtypes_plus_the_matmul_rule(kind, images, tokens):
    """With residuals="all", the converts of Flax's dtype= by hand, plus those the rule states.

    Flax's bf16 layers return 16-bit GEMM results; the matmul rule accumulates in
    float32, returns it and casts it. Against the hand-written program that is,
    per matmul of an activation and a float32 weight with both gradients, two
    more converts (the forward result, the activation gradient) plus the
    weight's 16-bit copy remade in the backward pass, less the float32 upcast of
    a 16-bit weight gradient the rule does not make; per matmul of two
    activations (attention), one more per GEMM.
    """
    if kind == "resnet":
        plain, hand, x = (
            tiny_resnet(),
            ResNet((1, 1), BasicBlock, 5, width=8, dtype=jnp.bfloat16),
            images,
        )
        variables = jax.jit(plain.init)(jax.random.key(0), x)

        def loss_of(model):
            return lambda p: resnet_loss(model, x)(p, variables["batch_stats"])[0]
    else:
        plain, hand, x = (
            BertClassifier(TINY_BERT),
            BertClassifier(TINY_BERT, dtype=jnp.bfloat16),
            tokens,
        )
        variables = jax.jit(plain.init)(jax.random.key(0), x)

        def loss_of(model):
            return lambda p: bert_loss(model, x)(p)[0]

    no_float32 = dataclasses.replace(jaxamp.AUTOCAST_RULES, float32=frozenset())
    policy = jaxamp.linen.apply_policy(plain, "mixed_bfloat16", residuals="all", rules=no_float32)
    ours = jaxamp.precision_report(jax.grad(loss_of(policy)))(variables["params"])
    theirs = jaxamp.precision_report(jax.grad(loss_of(hand)))(variables["params"])
    assert ours.by_dtype() == theirs.by_dtype()
    forward = sum(op.direction == "forward" for op in ours.ops)
    backward = len(ours.ops) - forward
    two_activation_matmuls = 2 * TINY_BERT.num_layers if kind == "bert" else 0
    with_weight_and_input_gradient = backward - forward - two_activation_matmuls
    expected = 2 * with_weight_and_input_gradient + 3 * two_activation_matmuls
    layers = [p for p in jax.tree_util.tree_leaves(variables["params"], is_leaf=_is_layer)]
    dense_biases = sum(1 for p in layers if _is_layer(p) and {"kernel", "bias"} <= set(p))
    position_embeddings = 1 if kind == "bert" else 0
    expected += 2 * (dense_biases + position_embeddings)
    assert ours.converts - theirs.converts == expected


def _is_layer(tree):
    return isinstance(tree, dict) and any(not isinstance(v, dict) for v in tree.values())


class DirectAttention(nn.Module):
    """Calls Flax's and JAX's attention and softmax functions directly, as transformers'
    Flax models do, instead of through a layer's ``attention_fn``."""

    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((2, 4), dtype=self.dtype, name=n)(x) for n in "qkv")
        weights = nn.dot_product_attention_weights(q, k, dtype=self.dtype)
        y = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        y = y + nn.dot_product_attention(q, k, v, dtype=self.dtype)
        y = y + jax.nn.dot_product_attention(q, k, v)
        y = nn.DenseGeneral(8, axis=(-2, -1), dtype=self.dtype, name="out")(y)
        return jax.nn.log_softmax(y) + jax.nn.softmax(y) + jax.nn.logsumexp(y, -1, keepdims=True)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", list(DTYPES))
def test_directly_called_softmax_runs_in_float32(name):
    """Every softmax, logsumexp and attention matmul of a model that calls them itself:
    sensitive operations in float32, matmuls accumulating in float32 (forward and backward)."""
    model = jaxamp.linen.apply_policy(DirectAttention(), name)
    x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    params = jax.jit(model.init)(jax.random.key(1), x)
    loss = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))
    report = jaxamp.precision_report(loss)(params).check(DTYPES[name])
    exps = [op for op in report.sensitive if op.primitive == "exp"]
    assert len(exps) >= 6 and {op.dtype for op in exps} == {"float32"}
    assert report.by_dtype() == {np.dtype(DTYPES[name]).name: len(report.ops)}
    grads = jax.jit(jax.grad(lambda p: loss(p)[0]))(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype("float32")}
    reference = jax.jit(jax.grad(lambda p: jnp.mean(DirectAttention().apply(p, x) ** 2)))(params)
    tolerance = {"float32": 1e-5, "mixed_bfloat16": 0.05, "mixed_float16": 0.01}[name]
    grads, reference = jax.tree.map(np.asarray, (grads, reference))
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(reference))
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        assert float(np.max(np.abs(ours - theirs))) <= tolerance * scale


class TwoMethods(nn.Module):
    features: int = 4

    def setup(self):
        self.dense = nn.Dense(self.features)

    def __call__(self, x):
        return jax.nn.softmax(self.dense(x))

    def encode(self, x):
        return self.dense(x)


def _dense_operands(report):
    return {op.operand_dtype for op in report.ops}


@pytest.mark.standard_promotion(SUBJECT)
def test_bind_tabulate_lazy_init_and_methods_keep_the_policy():
    model = jaxamp.linen.apply_policy(TwoMethods(), "mixed_bfloat16")
    x = jnp.ones((2, 3))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    assert jax.tree.structure(variables) == jax.tree.structure(
        jax.jit(TwoMethods().init)(jax.random.key(0), x)
    )
    bound = model.bind(variables)
    report = jaxamp.precision_report(lambda x: bound(x))(x).check(jnp.bfloat16)
    assert _dense_operands(report) == {"bfloat16"}
    assert bound(x).dtype == jnp.float32
    lazy = model.lazy_init(jax.random.key(0), jax.ShapeDtypeStruct((2, 3), jnp.float32))
    assert jax.tree.map(lambda a: a.shape, lazy) == jax.tree.map(lambda a: a.shape, variables)
    table = re.sub(r"\x1b\[[0-9;]*m", "", model.tabulate(jax.random.key(0), x, depth=2))
    dense_row = next(line for line in table.splitlines() if "│ dense" in line)
    assert "bfloat16[2,3]" in dense_row and "bfloat16[2,4]" in dense_row  # under the policy
    for method in ("encode", TwoMethods.encode):
        run = lambda v, x, method=method: model.apply(v, x, method=method)
        report = jaxamp.precision_report(run)(variables, x).check(jnp.bfloat16)
        assert _dense_operands(report) == {"bfloat16"}
        assert jax.jit(run)(variables, x).dtype == jnp.float32
    encoded = jaxamp.precision_report(lambda x: bound.encode(x))(x)
    assert _dense_operands(encoded) == {"bfloat16"}
    assert model.features == 4  # fields of the wrapped module are read through


class WithBackbone(nn.Module):
    @nn.compact
    def __call__(self, x):
        backbone = jaxamp.linen.apply_policy(TwoMethods(name="backbone"), "mixed_bfloat16")
        return nn.Dense(2, name="head")(backbone(x))


class Bare(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(TwoMethods(name="backbone")(x))


@pytest.mark.standard_promotion(SUBJECT)
def test_a_policy_module_is_a_submodule():
    x = jnp.ones((2, 3))
    variables = jax.jit(WithBackbone().init)(jax.random.key(0), x)
    bare = jax.jit(Bare().init)(jax.random.key(0), x)
    assert jax.tree.structure(variables) == jax.tree.structure(bare)  # where the bare one's are
    report = jaxamp.precision_report(
        jax.value_and_grad(lambda v: WithBackbone().apply(v, x).sum())
    )(variables)
    by_layer = {(op.layer.split("/")[-1], op.operand_dtype) for op in report.ops}
    assert ("dense", "bfloat16") in by_layer and ("head", "float32") in by_layer
    assert not [p for p in report.problems() if p.kind == "sensitive_in_16bit"]
    np.testing.assert_allclose(
        jax.jit(WithBackbone().apply)(variables, x),
        jax.jit(Bare().apply)(variables, x),
        rtol=0.02,
        atol=0.02,
    )


@pytest.mark.standard_promotion(SUBJECT)
def test_a_matmul_the_model_writes_follows_the_rules_compute_set():
    """The docstring said x @ self.param(...) runs in float32 and that rules.compute is
    unused; it runs in the compute dtype, and an empty compute set keeps it float32."""

    class Written(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.initializers.ones, (8, 8))

    x = jnp.ones((2, 8))
    variables = jax.jit(Written().init)(jax.random.key(0), x)

    def operands(rules):
        model = jaxamp.linen.apply_policy(Written(), "mixed_bfloat16", rules=rules)
        report = jaxamp.precision_report(lambda v, x: model.apply(v, x))(variables, x)
        return {(op.lhs_dtype, op.rhs_dtype) for op in report.ops}

    assert operands(None) == {("bfloat16", "bfloat16")}
    no_compute = dataclasses.replace(jaxamp.AUTOCAST_RULES, compute=frozenset())
    assert operands(no_compute) == {("float32", "float32")}


class _EncoderDecoder(nn.Module):
    def setup(self):
        self.body, self.head = nn.Dense(8), nn.Dense(4)

    def __call__(self, x):
        return self.head(self.body(x))

    def encode(self, x):
        return self.body(x)


def test_a_method_that_runs_part_of_the_model_does_not_warn(recwarn):
    """An override of the head is no typo when ``method="encode"`` runs the body alone."""
    model = jaxamp.linen.apply_policy(
        _EncoderDecoder(), "mixed_bfloat16", overrides={"head": "f32"}
    )
    x = jnp.ones((2, 4))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    jax.jit(lambda v: model.apply(v, x, method="encode"))(variables)
    jax.jit(lambda k: model.init(k, x, method="encode"))(jax.random.key(0))
    assert not [w for w in recwarn if "override" in str(w.message)]


def test_a_second_apply_policy_replaces_the_first():
    first = jaxamp.linen.apply_policy(
        _EncoderDecoder(), "mixed_bfloat16", overrides={"head": "f32"}
    )
    model = jaxamp.linen.apply_policy(first, "mixed_bfloat16", overrides={"body": "float32"})
    x = jnp.ones((2, 4))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    bare = jax.jit(_EncoderDecoder().init)(jax.random.key(0), x)
    assert jax.tree.structure(variables) == jax.tree.structure(bare)
    ops = jaxamp.precision_report(lambda v: model.apply(v, x))(variables).ops
    assert {op.lhs_dtype for op in ops if "head" in op.name} == {"bfloat16"}
    assert {op.lhs_dtype for op in ops if "head" not in op.name} == {"float32"}


@pytest.mark.parametrize("decode", [False, True])
def test_an_override_of_the_models_own_class_is_its_policy(decode):
    """{MultiHeadDotProductAttention: "float32"} on the attention layer itself: all of it,
    inputs and cache included, runs in float32, bit for bit the layer alone."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    module = nn.MultiHeadDotProductAttention(2, decode=decode)
    model = jaxamp.linen.apply_policy(
        module, "mixed_bfloat16", overrides={nn.MultiHeadDotProductAttention: "float32"}
    )
    variables = jax.jit(module.init)(jax.random.key(1), x)
    step = x[:, :1] if decode else x
    want = jax.jit(lambda v: module.apply(v, step, mutable=True))(variables)
    got = jax.jit(lambda v: model.apply(v, step, mutable=True))(variables)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("key", [nn.RNN, "rnn"])
def test_an_override_on_nn_rnn_reaches_its_cell(key):
    """nn.RNN's cell is bound beside it, not under it: the override matched the RNN and
    left every matmul of the cell in bfloat16 (and did not warn)."""
    x = jax.random.normal(jax.random.key(1), (2, 5, 3)).astype(jnp.bfloat16).astype(jnp.float32)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.RNN(nn.GRUCell(4), name="rnn")(x)

    model = Net()
    variables = jax.jit(model.init)(jax.random.key(0), x)
    policed = jaxamp.linen.apply_policy(model, "mixed_bfloat16", overrides={key: "float32"})
    report = jaxamp.precision_report(policed.apply)(variables, x)
    assert {op.lhs_dtype for op in report.ops} == {"float32"}
    np.testing.assert_array_equal(
        jax.jit(policed.apply)(variables, x), jax.jit(model.apply)(variables, x)
    )


class _Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x) * self.param("gain", nn.initializers.normal(), (8,))


class _WithField(nn.Module):
    """Holds its submodules as dataclass fields, one of them holding another."""

    tower: nn.Module
    head: nn.Module

    def __call__(self, x):
        return self.head(jnp.tanh(self.tower(x)))


class _Head(nn.Module):
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(self.inner(x))


def _field_model():
    return _WithField(_Tower(), _Head(_Tower()))


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("placement", ["root", "submodule"])
def test_init_under_a_policy_draws_field_submodules_values_as_the_model_alone(policy, placement):
    """Submodules held as dataclass fields (one inside another) get the values the model
    alone draws: Flax's share_scope kept the RNGs they derived before it moved them, so
    they drew other values (same structure). Also with the policy module as a field of a
    plain module."""
    x = jax.random.normal(jax.random.key(1), (2, 16))
    if placement == "root":
        bare, model = _field_model(), jaxamp.linen.apply_policy(_field_model(), policy)
    else:
        bare = _WithField(_field_model(), _Head(_Tower()))
        model = _WithField(jaxamp.linen.apply_policy(_field_model(), policy), _Head(_Tower()))
    want = jax.jit(bare.init)(jax.random.key(0), x)
    got = jax.jit(model.init)(jax.random.key(0), x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    if policy == "float32":  # the identity: the model alone's outputs too
        np.testing.assert_array_equal(jax.jit(model.apply)(got, x), jax.jit(bare.apply)(want, x))


class _Mid(nn.Module):
    tower: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.tower(x) + self.tower(2 * x)


def _lifted_outer(lift, tower):
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return lift(_Mid)(tower, name="mid")(x)

    return Outer()


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.filterwarnings(
    "ignore:A delayed float8 policy module runs inside a Flax"
)  # fp8_test's
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "p=f32,c=f32,fp8=delayed"])
@pytest.mark.parametrize("lift", [lambda m: m, nn.remat, nn.jit], ids=["none", "remat", "jit"])
def test_a_policy_module_held_by_a_lifted_module_keeps_the_variables_where_they_were(policy, lift):
    """A policy module held as a field by a module a Flax transformation lifts: its
    variables sit where the module alone's do (they sat under an extra 'module' level, so
    a checkpoint of the model alone was refused), with the same initial values."""
    x = jax.random.normal(jax.random.key(1), (2, 3))
    bare = _lifted_outer(lift, _Tower())
    model = _lifted_outer(lift, jaxamp.linen.apply_policy(_Tower(), policy))
    want = jax.jit(bare.init)(jax.random.key(0), x)
    got = jax.jit(model.init)(jax.random.key(0), x)
    assert jax.tree.structure(got["params"]) == jax.tree.structure(want["params"])
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"]), strict=True):
        np.testing.assert_array_equal(a, b)
    out = jax.jit(model.apply)({**got, "params": want["params"]}, x)  # the model alone's
    if policy == "float32":
        np.testing.assert_array_equal(out, jax.jit(bare.apply)(want, x))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("how", ["clone", "copy"])
def test_a_policy_module_cloned_with_a_field_of_the_wrapped_module_is_that_module(policy, how):
    """``clone``/``copy`` with a field of the wrapped module (read through the policy
    module) gives the policy module of the wrapped module with that field: same params and
    outputs, same policy. It raised TypeError. A name neither has is refused by name."""
    x = jax.random.normal(jax.random.key(1), (2, 8))
    cloned = getattr(jaxamp.linen.apply_policy(nn.Dense(4), policy), how)(features=16)
    want = jaxamp.linen.apply_policy(nn.Dense(16), policy)
    assert cloned.policy == want.policy and cloned.features == 16
    variables = jax.jit(cloned.init)(jax.random.key(0), x)
    want_variables = jax.jit(want.init)(jax.random.key(0), x)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(want_variables), strict=True):
        np.testing.assert_array_equal(a, b)
    out = jax.jit(cloned.apply)(variables, x)
    np.testing.assert_array_equal(out, jax.jit(want.apply)(variables, x))
    assert out.dtype == want.policy.output_dtype
    with pytest.raises(TypeError, match="featurez"):
        getattr(cloned, how)(featurez=3)


@pytest.mark.parametrize("how", ["clone", "copy"])
def test_a_policy_module_cloned_with_settings_takes_them_as_apply_policy_does(how):
    """``clone``/``copy`` with ``policy="mixed_bfloat16"`` (a name) or ``overrides={...}``
    (a mapping) give what ``apply_policy`` gives with them; a name was kept as a string
    and failed at ``apply``. Bad settings are refused by name at once."""
    x = jax.random.normal(jax.random.key(1), (2, 8))
    model = jaxamp.linen.apply_policy(nn.Dense(4), "float32")
    for updates in (
        {"policy": "mixed_bfloat16"},
        {"policy": "mixed_float16", "overrides": {nn.Dense: "float32"}, "residuals": "dots"},
    ):
        cloned = getattr(model, how)(**updates)
        want = jaxamp.linen.apply_policy(nn.Dense(4), **updates)
        assert (cloned.policy, cloned.overrides, cloned.residuals) == (
            want.policy,
            want.overrides,
            want.residuals,
        )
        variables = jax.jit(want.init)(jax.random.key(0), x)
        np.testing.assert_array_equal(
            jax.jit(cloned.apply)(variables, x), jax.jit(want.apply)(variables, x)
        )
    with pytest.raises(ValueError, match="mixed_bfloat17"):
        getattr(model, how)(policy="mixed_bfloat17")
    with pytest.raises(ValueError, match="nope"):
        getattr(model, how)(residuals="nope")


def test_a_clone_starts_from_the_policy_given_not_the_one_a_class_override_chose():
    """An override of the model's own class replaces the root policy; a clone that drops
    the override, or swaps the module for one the override matches, is what apply_policy
    gives with the same arguments (it kept the replaced policy, or missed the override:
    inputs cast to bfloat16 before a float32 layer)."""
    x = jax.random.normal(jax.random.key(3), (2, 4))
    pol = "mixed_float8_delayed"
    dense = lambda: nn.Dense(4)
    cases = [
        (
            jaxamp.linen.apply_policy(dense(), pol, overrides={nn.Dense: "float32"}),
            {"overrides": {}},
            jaxamp.linen.apply_policy(dense(), pol, overrides={}),
        ),
        (
            jaxamp.linen.apply_policy(
                nn.Sequential([dense()]), pol, overrides={nn.Dense: "float32"}
            ),
            {"module": dense()},
            jaxamp.linen.apply_policy(dense(), pol, overrides={nn.Dense: "float32"}),
        ),
    ]
    for model, updates, want in cases:
        cloned = model.clone(**updates)
        assert cloned.policy == want.policy
        variables = jax.jit(want.init)(jax.random.key(0), x)
        assert jax.tree.structure(jax.jit(cloned.init)(jax.random.key(0), x)) == jax.tree.structure(
            variables
        )
        np.testing.assert_array_equal(
            jax.jit(cloned.apply)(variables, x), jax.jit(want.apply)(variables, x)
        )


@pytest.mark.parametrize("placement", ["root", "submodule"])
def test_capture_intermediates_under_a_float32_policy_are_the_model_alones(placement):
    """A float32 policy is the identity for capture_intermediates too: a policy module
    used as a submodule recorded each call twice (its own and the wrapped module's)."""
    x = jax.random.normal(jax.random.key(1), (2, 16))
    bare = _WithField(_Tower(), _Head(_Tower()))
    if placement == "root":
        model = jaxamp.linen.apply_policy(_WithField(_Tower(), _Head(_Tower())), "float32")
    else:
        model = _WithField(jaxamp.linen.apply_policy(_Tower(), "float32"), _Head(_Tower()))
    variables = jax.jit(bare.init)(jax.random.key(0), x)
    run = lambda m: jax.jit(lambda v: m.apply(v, x, capture_intermediates=True, mutable=True))
    _, want = run(bare)(variables)
    _, got = run(model)(variables)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
