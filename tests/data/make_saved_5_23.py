"""Makes `saved-5.23/`: a tiny STEM checkpoint saved by stem-hf 774b1ef (remote code written for `past_key_values`)
under transformers 5.23.0, and `reference.safetensors`, its logits and greedy tokens there. tests/test_compat.py loads
it under the installed transformers after `stem-hf refresh-code` and compares with these fixed values.

Run from a checkout of 774b1ef under transformers 5.23.0 and torch 2.13.0 (CPU):
    PYTHONPATH=. python tests/data/make_saved_5_23.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from stem_hf import StemConfig, StemForCausalLM

assert transformers.__version__ == "5.23.0", transformers.__version__
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    stem_layers="1/2",
)
PROMPTS = torch.tensor([[1, 33, 70, 120, 9, 200, 45, 3], [1, 250, 7, 7, 64, 128, 99, 31]])
NEW_TOKENS = 8


def build() -> StemForCausalLM:
    """Weights drawn from a seeded generator in name order, large enough that greedy choices are clear."""
    model = StemForCausalLM(StemConfig(**CONFIG)).eval()
    generator = torch.Generator().manual_seed(2026)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            std = 1.0 if "stem_tables" in name else 0.15
            values = torch.randn(param.shape, generator=generator) * std
            param.copy_(values + 1.0 if name.endswith("norm.weight") else values)
    return model


def uncached_greedy(model: StemForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    for _ in range(NEW_TOKENS):
        next_ids = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_ids], dim=1)
    return ids


def main(out: str) -> None:
    out = Path(out)
    model = build()
    model.save_pretrained(out / "checkpoint")
    with torch.no_grad():
        logits = model(PROMPTS).logits
        cached = model.generate(
            PROMPTS, attention_mask=torch.ones_like(PROMPTS), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        uncached = uncached_greedy(model, PROMPTS)
    assert torch.equal(cached, uncached), (cached, uncached)
    save_file(
        {"prompts": PROMPTS, "logits": logits.contiguous(), "greedy": cached.contiguous()},
        out / "reference.safetensors",
        metadata={"transformers": transformers.__version__, "torch": torch.__version__, "stem_hf": "774b1ef"},
    )
    print(cached.tolist())


if __name__ == "__main__":
    main(sys.argv[1])
