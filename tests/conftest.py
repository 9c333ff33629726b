import os

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


def sensitive_model(std: float = 1.0, **overrides) -> StemForCausalLM:
    """A tiny model whose tables matter to its outputs: the paper's xavier init is tiny, so rows are drawn larger."""
    torch.manual_seed(0)
    model = tiny_model(**overrides)
    with torch.no_grad():
        for table in model.model.stem_tables.values():
            table.weight.normal_(0, std)
    return model


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose private (copy-on-write) mappings in this process hold the tensor's first and last bytes; None
    where its bytes are not a private map of one file (a copy in anonymous memory, or a tensor off the CPU)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size() - 1
    files = {first: set(), last: set()}
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[1].endswith("p") or not fields[5].startswith("/"):
                continue  # shared, anonymous, or a pseudo-file such as [heap]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for address, found in files.items():
                if start <= address < end:
                    found.add(os.path.realpath(fields[5].rstrip("\n")))
    both = files[first] & files[last]
    return both.pop() if len(both) == 1 else None


BYTE_VOCAB = 259  # <pad>, <s>, </s> and the 256 bytes


def byte_tokenizer():
    """A real fast tokenizer over bytes (no merges), ids matching TINY's pad/bos/eos: any text tokenizes, no Hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def position_weighted(t: torch.Tensor) -> list[float]:
    """A checksum that a swapped row or a misplaced shard changes, not only a changed value; and its scale."""
    weighted = t.double().flatten() * torch.arange(1, t.numel() + 1)
    return [weighted.sum().item(), weighted.abs().sum().item()]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
