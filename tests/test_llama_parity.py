"""Exactness anchor: with no STEM layer a StemForCausalLM is a LlamaForCausalLM (with qk_norm, a Qwen3ForCausalLM)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from stem_hf import StemForCausalLM
from tests.conftest import TINY, tiny_config


def _ids_and_left_padded_mask(vocab_size: int):
    input_ids = torch.randint(3, vocab_size, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    attention_mask[2, :9] = 0
    input_ids[attention_mask == 0] = TINY["pad_token_id"]
    return input_ids, attention_mask


def _random_biases(model):
    """Biases start at zero: randomize them, or a model that ignored them would pass."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return model


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_state_dict_gives_same_logits(attn_implementation, padded, tied):
    llama = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied, attn_implementation=attn_implementation))
    stem = StemForCausalLM(
        tiny_config(stem_layers=[], tie_word_embeddings=tied, attn_implementation=attn_implementation)
    )
    assert stem.config._attn_implementation == attn_implementation
    stem.load_state_dict(llama.state_dict(), strict=True)  # no renaming: Llama's names are STEM's names
    llama.eval(), stem.eval()

    input_ids, attention_mask = _ids_and_left_padded_mask(TINY["vocab_size"])
    if not padded:
        attention_mask = None
    with torch.no_grad():
        expected = llama(input_ids, attention_mask=attention_mask).logits
        actual = stem(input_ids, attention_mask=attention_mask).logits
    if padded:  # padded positions are garbage in both; compare the real ones
        keep = attention_mask.bool()
        expected, actual = expected[keep], actual[keep]
    assert (expected - actual).abs().max().item() < 1e-5


def test_llama_checkpoint_loads_with_from_pretrained(tmp_path):
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    llama.save_pretrained(tmp_path)
    stem, info = StemForCausalLM.from_pretrained(tmp_path, config=tiny_config(stem_layers=[]), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.allclose(llama(input_ids).logits, stem.eval()(input_ids).logits, atol=1e-5, rtol=0)


def test_qk_norm_matches_qwen3():
    qwen3 = _random_biases(Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=8, attention_bias=True)).eval())
    stem = StemForCausalLM(tiny_config(stem_layers=[], head_dim=8, attention_bias=True, qk_norm=True)).eval()
    stem.load_state_dict(qwen3.state_dict(), strict=True)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert (qwen3(input_ids).logits - stem(input_ids).logits).abs().max().item() < 1e-5


def test_q_k_v_bias_without_output_bias_matches_qwen2():
    qwen2 = _random_biases(Qwen2ForCausalLM(Qwen2Config(**TINY)).eval())
    stem = StemForCausalLM(tiny_config(stem_layers=[], attention_bias=True, attention_out_bias=False)).eval()
    stem.load_state_dict(qwen2.state_dict(), strict=True)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert (qwen2(input_ids).logits - stem(input_ids).logits).abs().max().item() < 1e-5
