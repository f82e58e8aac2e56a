"""A Linen model to write with Flax's own float8 ops (``dot_general_cls``) as the reference
for jaxamp's float8 policies and autocast."""

import flax.linen as nn


class Mlp(nn.Module):
    """Two Dense layers; ``dot_general_cls`` (Flax's Fp8DirectDotGeneralOp) for both."""

    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, dot_general_cls=self.dot_general_cls)(x))
        return nn.Dense(4, dot_general_cls=self.dot_general_cls)(h)
