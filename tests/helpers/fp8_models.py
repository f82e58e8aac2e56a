"""A Linen model to write with Flax's own float8 ops (``dot_general_cls``) as the reference
for jaxamp's float8 policies and autocast."""

import flax.linen as nn

# Widths of a small transformer's MLP block (256 -> 512 -> 128 on 64 tokens): GEMMs whose
# float32 sums run over hundreds of products, as a model's do, and still fast on a CPU.
REALISTIC_FEATURES = (512, 128)
REALISTIC_INPUT = (64, 256)


class Mlp(nn.Module):
    """Dense layers of ``features`` with a relu between; ``dot_general_cls`` (Flax's
    Fp8DirectDotGeneralOp) for all of them."""

    dot_general_cls: object = None
    features: tuple[int, ...] = (16, 4)

    @nn.compact
    def __call__(self, x):
        *hidden, last = self.features
        for width in hidden:
            x = nn.relu(nn.Dense(width, dot_general_cls=self.dot_general_cls)(x))
        return nn.Dense(last, dot_general_cls=self.dot_general_cls)(x)
