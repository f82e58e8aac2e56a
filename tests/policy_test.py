"""Tests for jaxamp/_src/policy.py: the grammar, the presets, casting and errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.policy import Policy, cast_floating, get_policy

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("p=f32,c=f16", (F32, F16, F16)),  # output follows compute (jmp's rule)
        ("c=bf16", (F32, BF16, BF16)),  # params default to float32
        ("p=bf16", (BF16, BF16, BF16)),  # compute follows params
        (" P = f32 , C = BF16 ", (F32, BF16, BF16)),  # whitespace and case
        ("full", (F32, F32, F32)),
        ("f32", (F32, F32, F32)),
        ("bf16", (BF16, BF16, BF16)),
        ("float32", (F32, F32, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("float16", (F16, F16, F16)),
    ],
)
def test_get_policy_grammar_and_presets(spec, expected):
    policy = get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_half_follows_jmp():
    assert get_policy("half").compute_dtype == np.dtype(jmp.half_dtype())
    assert get_policy("p=f32,c=half").compute_dtype == np.dtype(jmp.half_dtype())


def test_grammar_agrees_with_jmp():
    for spec in ("p=f32,c=bf16,o=f32", "c=f16", "p=bf16,c=f16", "params=f32,output=bf16"):
        ours, theirs = get_policy(spec), jmp.get_policy(spec)
        assert ours.param_dtype == np.dtype(theirs.param_dtype)
        assert ours.compute_dtype == np.dtype(theirs.compute_dtype)
        assert ours.output_dtype == np.dtype(theirs.output_dtype)


def test_reduce_key():
    policy = get_policy("p=f32,c=bf16,o=f32,r=bf16")
    assert policy.reduce_dtype == BF16 and policy.grad_reduce_dtype == BF16
    assert get_policy("params=f32,compute=bf16,reduce=f16").grad_reduce_dtype == np.dtype("float16")
    assert get_policy(str(policy)) == policy  # the long key parses back
    # without it: float32 under a 16-bit compute dtype, the params' dtype otherwise
    assert get_policy("mixed_bfloat16").reduce_dtype is None
    assert get_policy("mixed_bfloat16").grad_reduce_dtype == F32
    assert get_policy("bfloat16").grad_reduce_dtype == F32
    assert get_policy("p=f16,c=f32,o=f32").grad_reduce_dtype == np.dtype("float16")
    assert str(policy) == "params=float32,compute=bfloat16,output=float32,reduce=bfloat16"
    # alone, it keeps jmp's default params (it quoted jmp's error about a dtype '')
    alone = get_policy("r=bf16")
    assert (alone.param_dtype, alone.compute_dtype, alone.reduce_dtype) == (F32, F32, BF16)


def test_bad_dtypes_are_named_never_guessed():
    """None became float64; an integer cast truncated; "bf16" raised numpy's bare
    TypeError; a list of names as overrides raised "too many values to unpack"."""
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        with pytest.raises(ValueError, match=f"Unknown {field} None. Valid choices"):
            Policy(**{field: None})
    tree = {"w": jnp.full(2, 1.5), "step": jnp.zeros((), jnp.int32)}
    with pytest.raises(ValueError, match="must be a floating dtype, got 'int32'"):
        cast_floating(tree, jnp.int32)
    assert cast_floating(tree, "bf16")["w"].dtype == BF16
    assert cast_floating(tree, "bf16")["step"].dtype == jnp.int32
    with pytest.raises(TypeError, match=r"overrides must map .* item 'head' is not a"):
        jaxamp.linen.apply_policy(nn.Dense(2), "float32", overrides=["head"])


def test_policy_and_jmp_policy_pass_through():
    policy = Policy("float32", "bfloat16", "float32")
    assert get_policy(policy) is policy
    assert get_policy(jmp.get_policy("p=f32,c=bf16,o=f32")) == policy


def test_str_round_trips():
    for name, policy in jaxamp.PRESETS.items():
        assert get_policy(str(policy)) == policy, name


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("mixed_bf16", "Did you mean 'mixed_bfloat16'"),
        ("mixed_bf16", "mixed_float16"),  # valid choices are listed
        ("p=f32,x=bf16", "unknown key 'x'"),
        ("p=f32,c=bf15", "'bf15'"),
        ("p=f32,c", "part 'c' is not of the form key=dtype"),
        ("p=f32,p=bf16", "'params' is given twice"),
        ("p=f32,,c=bf16", "is not of the form"),
        ("p=int8", "'int8'"),
        ("", "Valid choices"),
    ],
)
def test_bad_specs_name_the_bad_part(spec, fragment):
    with pytest.raises(ValueError, match=r"Valid|unknown key|given twice|not of the form") as e:
        get_policy(spec)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("mixed_float8_delayed,fp8_history=4", "'params=float32,compute=bfloat16,output=float32"),
        ("mixed_bfloat16,c=f16", "cannot be combined with key=value parts"),
        ("f32,c=bf16", "'params=float32,compute=float32,output=float32'"),
        ("p=f32,fp8=current,fp8_history=16", "fp8=current scales by each tensor's own amax"),
    ],
)
def test_a_preset_with_keys_or_a_history_without_one_is_refused_saying_why(spec, fragment):
    """A preset (or dtype name) followed by keys is refused with the preset written out,
    not with 'Did you mean' the same name; an amax history under current scaling, which
    keeps none, is refused rather than ignored."""
    with pytest.raises(ValueError) as e:
        get_policy(spec)
    assert fragment in str(e.value) and "Did you mean" not in str(e.value), e.value


def test_a_bad_dtype_is_named_once():
    with pytest.raises(ValueError) as e:
        get_policy("p=f32,c=bf17")
    assert str(e.value).count("bf17") == 2, e.value  # the policy, then the bad part
    assert "'compute'" in str(e.value) and "Valid choices: " in str(e.value)


def test_non_string_spec_is_a_type_error():
    with pytest.raises(TypeError, match="got int"):
        get_policy(3)


def test_policy_rejects_non_floating_dtypes():
    with pytest.raises(ValueError, match="compute_dtype must be a floating dtype, got 'int32'"):
        Policy("float32", jnp.int32, "float32")
    with pytest.raises(ValueError, match=r"Unknown param_dtype 'fp8'"):
        Policy("fp8", "float32", "float32")


def test_policy_is_frozen_hashable_and_a_static_argument():
    policy = get_policy("mixed_bfloat16")
    with pytest.raises(AttributeError):
        policy.compute_dtype = F32
    assert hash(policy) == hash(Policy(jnp.float32, jnp.bfloat16, jnp.float32))
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def f(x, policy):
        traces.append(1)
        return policy.cast_to_compute(x)

    x = jnp.ones(3)
    assert f(x, policy).dtype == BF16
    assert f(x, get_policy("p=f32,c=bf16,o=f32")).dtype == BF16
    assert len(traces) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_casts_touch_only_floating_leaves(dtype):
    tree = {
        "w": jnp.ones((2, 2), jnp.float32),
        "h": np.ones(3, np.float16),
        "ids": jnp.arange(3),
        "mask": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
        "scale": 2.0,
        "name": "layer",
        "nothing": None,
    }
    policy = Policy(dtype, dtype, dtype)
    for cast in (policy.cast_to_param, policy.cast_to_compute, policy.cast_to_output):
        out = cast(tree)
        assert out["w"].dtype == dtype and out["h"].dtype == dtype
        assert out["ids"].dtype == tree["ids"].dtype
        assert out["mask"].dtype == jnp.bool_
        assert out["key"].dtype == tree["key"].dtype
        assert out["raw_key"].dtype == jnp.uint32
        assert out["scale"] == 2.0 and out["name"] == "layer" and out["nothing"] is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_casts_under_jit(dtype):
    policy = Policy(jnp.float32, dtype, jnp.float32)
    tree = {"x": jnp.ones(4), "step": jnp.zeros([], jnp.int32)}
    out = jax.jit(policy.cast_to_compute)(tree)
    assert out["x"].dtype == dtype and out["step"].dtype == jnp.int32
    back = jax.jit(policy.cast_to_output)(out)
    assert back["x"].dtype == jnp.float32


def test_cast_to_same_dtype_emits_no_convert():
    text = jax.jit(lambda x: cast_floating(x, jnp.float32)).lower(jnp.ones(3)).as_text()
    assert "convert" not in text


def test_is_mixed():
    assert get_policy("mixed_float16").is_mixed
    assert not get_policy("float32").is_mixed
    assert not get_policy("bfloat16").is_mixed
