"""PEFT on STEM models: LoRA on attention and the dense FFN projections, table rows trained as deltas through
`trainable_token_indices`; the adapter trains, saves, reloads and merges with identical outputs."""

import copy
import json
import os
import sys

import pytest
import torch
from peft import PeftModel, PromptTuningConfig, get_peft_model
from safetensors import safe_open

from stem_hf import modeling_stem
from stem_hf.modeling_stem import StemTable, StemTableRows
from stem_hf.training import lora_config
from tests.conftest import AllocatedShapes, _dataset, benchmark_script, sensitive_model, tiny_model

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


# PEFT's trainable tokens as rows: the layer looks the table up and puts the trained rows in (issue 36)


def _token_model(vocab: int = 96, **config):
    """A LoRA model with `ROWS` trained as tokens, its trained rows and LoRA's B moved off their initial values (so
    that outputs and gradients show where each is used)."""
    torch.manual_seed(0)
    base = tiny_model(vocab_size=vocab, table_dtype="float32")
    model = get_peft_model(base, lora_config(base, r=4, token_ids=ROWS, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name or "lora_B" in name:
                param.normal_(0, 0.5)
    return model


def _peft_forward(model) -> list:
    """Makes the model call PEFT's own forward of its trainable tokens (a merged copy of each table): any hook on the
    wrapper hands the lookup to it. Returns the hooks' handles."""
    wrappers = [m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    assert len(wrappers) == 2
    return [wrapper.register_forward_pre_hook(lambda *args: None) for wrapper in wrappers]


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


# Trained ids repeated and alone, untrained ids between them, a trained id (40) in the second sequence only.
TOKEN_IDS = torch.tensor([[ROWS[0], 3, ROWS[1], 7, ROWS[0], 11, 2, 13], [ROWS[2], ROWS[2], 6, ROWS[0], 8, 9, 10, 4]])


def test_trainable_tokens_give_the_outputs_and_gradients_of_peft_merged_tables():
    """The layers put the trained rows into the table's rows at their ids: the logits and every gradient (trained
    rows, LoRA) of PEFT's own forward, which merges the rows into a copy of each table, and the logits of the model
    PEFT merges for good."""
    model = _token_model().train()
    logits, grads = _step(model, TOKEN_IDS)
    handles = _peft_forward(model)
    expected_logits, expected = _step(model, TOKEN_IDS)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert grads.keys() == expected.keys() and any("trainable_tokens_delta" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    deltas = [g for n, g in grads.items() if "trainable_tokens_delta" in n]
    assert all(d.abs().sum(1).gt(0).all() for d in deltas)  # every trained row is in the batch: each has a gradient
    merged = copy.deepcopy(model).eval().merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=TOKEN_IDS).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [96, 384])
def test_trainable_tokens_never_copy_a_table(vocab):
    """A train step (forward, backward) and an inference forward with trainable tokens make no `[vocab, d_ff]` tensor,
    at two vocabulary sizes; PEFT's own forward makes one per table (a merged copy, its gradient)."""
    model = _token_model(vocab).train()
    for peft_forward in (False, True):
        handles = _peft_forward(model) if peft_forward else []
        with AllocatedShapes(model) as trained:
            model(input_ids=TOKEN_IDS, labels=TOKEN_IDS).loss.backward()
        with torch.no_grad(), AllocatedShapes(model) as inferred:
            model.eval()(input_ids=TOKEN_IDS)
        model.train()
        for handle in handles:
            handle.remove()
        assert ((vocab, 64) in trained) is peft_forward and ((vocab, 64) in inferred) is peft_forward


def test_trainable_tokens_off_merged_or_hooked_are_served_by_peft_as_before(tmp_path):
    """Adapters disabled: the base model's outputs; merged into the table: the trained outputs; with several adapters
    loaded, the one set active is used."""
    model = _token_model().eval()
    torch.manual_seed(0)
    plain = tiny_model(table_dtype="float32").eval()
    with torch.no_grad():
        trained = model(input_ids=TOKEN_IDS).logits
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, plain(input_ids=TOKEN_IDS).logits)
        torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=0, atol=0)
    model.save_pretrained(tmp_path / "first")
    model.add_adapter("second", lora_config(plain, r=4, token_ids=[3, 7]))
    model.set_adapter("second")
    with torch.no_grad():
        second = model(input_ids=TOKEN_IDS).logits
        model.set_adapter("default")
        torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=0, atol=0)
    assert not torch.allclose(second, trained)
    for wrapper in (m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"):
        wrapper.token_adapter.merge(adapter_names=["default"])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=1e-5, atol=1e-5)


def test_trainable_tokens_on_host_tables_are_fetched_ahead_with_the_resident_outputs(monkeypatch):
    """With the tables in host memory (served as a model on an accelerator serves them, the ids on the CPU here), the
    worker fetches the tables' rows ahead, as for a plain table, and the trained rows go in after: the resident
    logits and gradients."""
    model = _token_model().train()
    logits, grads = _step(model, TOKEN_IDS)
    fetched, fetch = [], StemTableRows._fetch
    monkeypatch.setattr(modeling_stem, "HOST_AT_ONCE_MAX_IDS", 0)  # inference forwards fetched ahead too
    monkeypatch.setattr(StemTableRows, "host_served", lambda self, table: True)
    monkeypatch.setattr(
        StemTableRows, "_fetch", lambda self, table, *args: fetched.append(table) or fetch(self, table, *args)
    )
    host_logits, host_grads = _step(model, TOKEN_IDS)
    tables = [m.token_adapter.base_layer for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    assert fetched == tables and all(type(t) is StemTable for t in tables)
    torch.testing.assert_close(host_logits, logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(host_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=TOKEN_IDS).logits, logits, rtol=0, atol=0)
    assert fetched[2:] == tables


def test_train_casts_the_trained_rows_to_float32_and_leaves_the_table_peft_freezes_as_stored():
    """bf16 tables under trainable tokens: `train()` casts the trained rows (which train) to float32, never the frozen
    table (it cast a copy of the whole table before, as if the table trained), and the outputs are PEFT's own."""
    torch.manual_seed(0)
    base = tiny_model(table_dtype="bfloat16")
    model = get_peft_model(base, lora_config(base, r=4, token_ids=ROWS)).train()
    wrappers = [m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    assert len(wrappers) == 2
    for wrapper in wrappers:
        assert wrapper.token_adapter.base_layer.weight.dtype == torch.bfloat16
        assert wrapper.token_adapter.trainable_tokens_delta["default"].dtype == torch.float32
    logits, grads = _step(model, TOKEN_IDS)
    handles = _peft_forward(model)
    expected_logits, expected = _step(model, TOKEN_IDS)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_peft_tokens_benchmark_finds_table_copies_in_peft_forward_only(tmp_path, monkeypatch):
    """`benchmarks/bench_peft_tokens.py` at a tiny shape: both ways timed, equal logits, and the allocation recorder
    sees a tensor of a table's size per STEM layer in PEFT's own inference forward (and more in its train step), none
    in the model's path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    out = tmp_path / "peft_tokens.json"
    argv = ["bench_peft_tokens.py", "--shape", "tiny", "--seq-len", "40", "--tokens", "8", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    benchmark_script("bench_peft_tokens").main()
    report = json.loads(out.read_text())
    assert report["table_shape"] == [512, 128] and report["trained_ids_in_batch"] > 0
    for mode, copies in (("train", 2), ("inference", 2)):
        figures = report[mode]
        assert figures["rows_ms"] > 0 and figures["peft_ms"] > 0 and figures["logits_max_diff"] == 0
        assert figures["rows_table_copies"] == 0 and figures["peft_table_copies"] >= copies
        assert figures["rows_allocated_mib"] < figures["peft_allocated_mib"]


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
