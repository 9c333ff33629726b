"""Size and cost of a STEM model next to the dense model of the same shape, from its config alone."""

import torch
from transformers import AutoConfig

from .configuration_stem import StemConfig
from .modeling_stem import StemForCausalLM


def summarize(config: StemConfig, context_length: int = 2048) -> dict:
    """Parameter counts and forward FLOPs per token, STEM vs dense. Builds the model on the meta device: no memory."""
    with torch.device("meta"):
        model = StemForCausalLM(config)
    stem_flops = model.flops_per_token(context_length)
    dense_flops = model.flops_per_token(context_length, dense=True)
    return {
        "stem_layers": list(config.stem_layers),
        "num_hidden_layers": config.num_hidden_layers,
        "total_params": model.num_parameters(),
        "table_params": model.num_table_parameters(),
        "active_params_per_token": model.num_active_parameters(),
        "dense_params": model.num_dense_parameters(),
        "context_length": context_length,
        "flops_per_token": stem_flops,
        "dense_flops_per_token": dense_flops,
        "flops_ratio_stem_over_dense": stem_flops / dense_flops,
    }


def load_config(path_or_id: str) -> StemConfig:
    config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=True)
    if config.model_type != StemConfig.model_type:
        raise ValueError(f"{path_or_id} holds a {config.model_type!r} config, not a STEM one (model_type 'stem')")
    return config
