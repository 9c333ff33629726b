"""stem-hf: STEM (Scaling Transformers with Embedding Modules) for Hugging Face Transformers.

Importing the package registers the `"stem"` architecture with the Auto classes (and as a causal LM where Trainer's
label smoothing looks for one) and marks the model files to be copied next to the weights on `save_pretrained`, so
checkpoints also load with `trust_remote_code=True` where this package is not installed. It also gives saves a model
card (`README.md`, see `stem_hf.model_card`), and pushes the card and provenance files with the weights
(`stem_hf.hub.push_model`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .configuration_stem import STEM_RATIOS, StemConfig, resolve_stem_layers
from .hub import push_model
from .model_card import card_after_save, write_model_card
from .modeling_stem import StemForCausalLM, StemModel, StemPreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(StemConfig.model_type, StemConfig, exist_ok=True)
AutoModel.register(StemConfig, StemModel, exist_ok=True)
AutoModelForCausalLM.register(StemConfig, StemForCausalLM, exist_ok=True)
# Trainer shifts the labels for its label smoother (`label_smoothing_factor`) only for the causal LMs this names:
# listed, STEM learns the next token there too, as Llama does (unlisted, the current one, silently).
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(StemConfig.model_type, StemForCausalLM.__name__)
StemConfig.register_for_auto_class()
StemModel.register_for_auto_class("AutoModel")
StemForCausalLM.register_for_auto_class("AutoModelForCausalLM")
StemPreTrainedModel._model_card_writer = staticmethod(card_after_save)
StemPreTrainedModel._hub_pusher = staticmethod(push_model)

__all__ = [
    "STEM_RATIOS",
    "StemConfig",
    "StemForCausalLM",
    "StemModel",
    "StemPreTrainedModel",
    "resolve_stem_layers",
    "write_model_card",
]
