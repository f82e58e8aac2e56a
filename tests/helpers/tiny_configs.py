"""Model configurations small enough for tests on a CPU, shared by the test modules."""

from jaxamp.models import BertConfig, GPT2Config

TINY_BERT = BertConfig(
    vocab_size=64,
    hidden_size=16,
    num_layers=2,
    num_heads=2,
    intermediate_size=32,
    max_position=16,
    num_classes=3,
)
TINY_GPT2 = GPT2Config(vocab_size=64, max_position=16, hidden_size=16, num_layers=2, num_heads=2)
