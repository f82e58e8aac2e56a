"""A tiny model with a residual branch silenced by a zero-initialised scale, shared by the
divergence tests: ResNets zero-initialise the last BatchNorm scale of each block, so that
branch's output and its parameters' gradients are (near) zero in float32."""

import flax.linen as nn
import jax
import jax.numpy as jnp

X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)


class Gate(nn.Module):
    """Multiplies its input by a per-feature scale initialised to ``init``."""

    init: float = 0.0

    @nn.compact
    def __call__(self, x):
        return x * self.param("scale", nn.initializers.constant(self.init), (x.shape[-1],))


class GatedNet(nn.Module):
    """``head(h + gate(branch(h)))`` with ``h = relu(embed(x))``."""

    gate: float = 0.0

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="embed")(x))
        branch = Gate(self.gate, name="gate")(nn.Dense(16, name="branch")(h))
        return nn.Dense(3, name="head")(h + branch)


def gated_setup(gate: float):
    """The float32 loss of a :class:`GatedNet` with this gate, and its params."""
    model = GatedNet(gate)
    params = model.init(jax.random.key(0), X)
    return (lambda p, x: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)), params
