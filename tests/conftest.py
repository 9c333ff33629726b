import pytest
import torch

from stem_hf import StemConfig, StemForCausalLM

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(**overrides) -> StemConfig:
    return StemConfig(**{**TINY, "stem_layers": [1, 3], **overrides})


def tiny_model(**overrides) -> StemForCausalLM:
    return StemForCausalLM(tiny_config(**overrides)).eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
