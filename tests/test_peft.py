"""PEFT on STEM models: LoRA on attention and the dense FFN projections, table rows trained as deltas through
`trainable_token_indices`; the adapter trains, saves, reloads and merges with identical outputs."""

import copy

import pytest
import torch
from peft import PeftModel, PromptTuningConfig, get_peft_model
from safetensors import safe_open

from stem_hf.training import lora_config
from tests.conftest import _dataset, sensitive_model, tiny_model

ROWS = [5, 9, 40]


def _base():
    torch.manual_seed(0)
    return tiny_model(table_dtype="float32")


def test_a_lora_adapter_trains_saves_reloads_and_merges(tmp_path):
    model = get_peft_model(_base(), lora_config(_base(), r=4, token_ids=ROWS))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in n for n in trainable) and any("down_proj.lora_B" in n for n in trainable)
    assert any("stem_tables.1" in n for n in trainable)  # the row deltas...
    assert not any(n.endswith("stem_tables.1.weight") for n in trainable)  # ...never the whole table
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) < 0.2 * model.num_parameters()

    batch = _dataset(8)[:]
    ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])
    ids[:, 0], labels[:, 0] = ROWS[0], ROWS[0]  # a trained row is in every batch
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits

    model.save_pretrained(tmp_path / "adapter")
    saved = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        table_tensors = {k: f.get_slice(k).get_shape() for k in f.keys() if "stem_tables" in k}
    assert len(table_tensors) == 2 and all(shape[0] == len(ROWS) for shape in table_tensors.values())  # rows only
    reloaded = PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
    base = _base()
    changed = (merged.model.stem_tables["1"].weight != base.model.stem_tables["1"].weight).any(dim=1)
    changed = changed.nonzero().squeeze(1).tolist()
    assert ROWS[0] in changed and set(changed) <= set(ROWS)  # no row outside token_ids moves
    assert type(merged.model.stem_tables["1"]).__name__ == "StemTable"


def test_bad_lora_requests_are_clear_errors():
    with pytest.raises(ValueError, match="token_ids: 500 is outside the vocabulary"):
        lora_config(_base(), token_ids=[1, 500])
    with pytest.raises(ValueError, match="no STEM layers"):
        lora_config(tiny_model(stem_layers=[]), token_ids=[1])


def test_an_adapter_loads_through_peft_and_through_transformers_load_adapter(tmp_path):
    from packaging.version import Version
    from peft import __version__ as peft_version
    from transformers.integrations.peft import MIN_PEFT_VERSION

    config = lora_config(_base(), r=4, token_ids=ROWS)
    config.init_lora_weights = False  # a non-zero adapter, so that loading it changes the logits
    get_peft_model(_base(), config).save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, ROWS[0], 7, ROWS[1], 11]])
    with torch.no_grad():
        plain = _base()(input_ids=ids).logits
        expected = PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()(input_ids=ids).logits
    assert not torch.allclose(expected, plain)
    base = _base()
    base.load_adapter(str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(base.eval()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    if Version(peft_version) < Version(MIN_PEFT_VERSION):  # transformers 5.24 asks for peft 0.22 (docs/training.md)
        with pytest.raises(ValueError, match=f"version >= {MIN_PEFT_VERSION}"):
            base.disable_adapters()
        return
    base.disable_adapters()
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, plain, rtol=0, atol=0)


# PEFT prompt tuning: soft prompts get zero table rows (issue 23)


IDS = torch.tensor([[1, 5, 6, 7, 9, 11, 13]])


def test_peft_prompt_tuning_trains_and_generates_with_soft_prompts_on_zero_rows():
    model = sensitive_model(std=3.0, table_dtype="float32")
    peft_model = get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with pytest.raises(ValueError, match="with PEFT prompt tuning, pass the text's input ids as `stem_input_ids`"):
        peft_model(input_ids=IDS, labels=IDS)
    out = peft_model(input_ids=IDS, labels=IDS, stem_input_ids=IDS)
    out.loss.backward()
    prompt_grad = peft_model.prompt_encoder["default"].embedding.weight.grad
    assert torch.isfinite(out.loss) and prompt_grad is not None and prompt_grad.abs().sum() > 0

    # The same forward on a copy where token 95 (not in the text) has zero rows, looked up at the soft positions: an
    # equal-length lookup that does not go through the soft-prompt path.
    reference = copy.deepcopy(model)
    for table in reference.model.stem_tables.values():
        table.weight.data[95] = 0
    soft = peft_model.get_prompt(batch_size=1).detach()
    embeds = torch.cat([soft, model.get_input_embeddings()(IDS)], dim=1)
    pad = torch.full((1, 3), 95)
    with torch.no_grad():
        by_hand = reference(inputs_embeds=embeds, stem_input_ids=torch.cat([pad, IDS], 1)).logits
        at_the_end = reference(inputs_embeds=embeds, stem_input_ids=torch.cat([IDS, pad], 1)).logits
    assert torch.allclose(out.logits.detach(), by_hand, atol=1e-5)
    assert not torch.allclose(out.logits.detach(), at_the_end, atol=1e-3)  # zero rows at the wrong end would show
    generated = peft_model.generate(input_ids=IDS, max_new_tokens=1, do_sample=False)
    assert generated[0, -1] == by_hand[0, -1].argmax()


@pytest.mark.parametrize("peft_kwargs", [{"token_ids": [5, 7]}, {"modules_to_save": ["stem_tables.1"]}])
def test_stem_trainer_trains_a_peft_model_with_dense_gradients_for_tables_peft_renames(tmp_path, peft_kwargs):
    """PEFT's copies of a table are named otherwise than `stem_tables.N.weight`, so `param_groups` puts them in a dense
    group; `StemTrainer`'s default leaves their gradients dense (a sparse one there would be refused)."""
    from transformers import TrainingArguments

    from stem_hf.training import StemTrainer

    base = _base()
    model = get_peft_model(base, lora_config(base, r=4, **peft_kwargs))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, learning_rate=1e-2, disable_tqdm=True)  # fmt: skip
    trainer = StemTrainer(model=model, args=args, train_dataset=_dataset(8))
    assert not trainer.sparse_table_grads
    trainer.train()
    assert trainer.state.global_step == 2
