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


def _token_model(vocab: int = 96, config=None):
    """A LoRA model with `ROWS` trained as tokens (or `config`'s), its trained rows and LoRA's B moved off their
    initial values (so that outputs and gradients show where each is used)."""
    torch.manual_seed(0)
    base = tiny_model(vocab_size=vocab, table_dtype="float32")
    model = get_peft_model(base, config or lora_config(base, r=4, token_ids=ROWS))
    _perturb(model, "default")
    return model


def _perturb(model, adapter: str) -> None:
    """Moves `adapter`'s trained rows and LoRA B off their initial values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(f".{adapter}") and ("trainable_tokens_delta" in name or "lora_B" in name):
                param.normal_(0, 0.5)


def _with_peft_forward(model, fn):
    """`fn()` with PEFT's own forward of the trainable tokens (`_peft_forward`)."""
    handles = _peft_forward(model)
    try:
        return fn()
    finally:
        for handle in handles:
            handle.remove()


def _peft_forward(model) -> list:
    """Makes the model call PEFT's own forward of its trainable tokens (a merged copy of each table): any hook on the
    wrapper hands the lookup to it. Returns the hooks' handles."""
    wrappers = [m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    assert wrappers
    return [wrapper.register_forward_pre_hook(lambda *args: None) for wrapper in wrappers]


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    named = model.named_parameters()
    return out.logits.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in named if p.requires_grad}


# Trained ids repeated and alone, untrained ids between them and above the largest trained one, a trained id (40) in
# the second sequence only.
TOKEN_IDS = torch.tensor([[ROWS[0], 3, ROWS[1], 7, ROWS[0], 11, 90, 13], [ROWS[2], ROWS[2], 6, ROWS[0], 8, 95, 10, 4]])


def test_trainable_tokens_give_the_outputs_and_gradients_of_peft_merged_tables():
    """The layers put the trained rows into the table's rows at their ids: the logits and every gradient (trained
    rows, LoRA) of PEFT's own forward, which merges the rows into a copy of each table, and the logits of the model
    PEFT merges for good."""
    model = _token_model().train()
    logits, grads = _step(model, TOKEN_IDS)
    expected_logits, expected = _with_peft_forward(model, lambda: _step(model, TOKEN_IDS))
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


@torch.no_grad()
def test_trainable_tokens_follow_the_active_adapter_and_leave_the_rest_to_peft():
    """Adapters disabled: the base model's outputs; another adapter set active: its rows (PEFT's own outputs for it);
    a mixed batch (`adapter_names`, whose hooks hand the lookup to PEFT): each row's adapter's outputs; merged into the
    table: the trained outputs."""
    model = _token_model().eval()
    torch.manual_seed(0)
    plain = tiny_model(table_dtype="float32").eval()
    trained = model(input_ids=TOKEN_IDS).logits
    with model.disable_adapter():
        torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, plain(input_ids=TOKEN_IDS).logits)
    torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=0, atol=0)
    model.add_adapter("second", lora_config(plain, r=4, token_ids=[3, 7, 9]))  # 9 is the first adapter's too
    _perturb(model, "second")
    model.set_adapter("second")
    second = model(input_ids=TOKEN_IDS).logits
    torch.testing.assert_close(second, _with_peft_forward(model, lambda: model(input_ids=TOKEN_IDS).logits))
    assert not torch.allclose(second, trained, atol=1e-3)
    model.set_adapter("default")
    torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=0, atol=0)
    mixed = model(input_ids=TOKEN_IDS, adapter_names=["second", "default"]).logits
    torch.testing.assert_close(mixed, torch.stack([second[0], trained[1]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=0, atol=0)  # the hooks are gone
    for wrapper in (m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"):
        wrapper.token_adapter.merge(adapter_names=["default"])
    torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, trained, rtol=1e-5, atol=1e-5)


def test_trainable_tokens_in_any_order_and_compiled_give_peft_outputs():
    """Trained ids in no order (PEFT's own config; `lora_config` sorts them): each id gets its own row. Under
    `torch.compile(fullgraph=True)`, in inference and training, the eager outputs and gradients."""
    from peft import LoraConfig

    indices = [40, 5, 90, 9]
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"stem_tables.1": indices})
    model = _token_model(config=config).train()
    logits, grads = _step(model, TOKEN_IDS)
    expected_logits, expected = _with_peft_forward(model, lambda: _step(model, TOKEN_IDS))
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    delta = next(g for n, g in grads.items() if "trainable_tokens_delta" in n)
    assert delta.abs().sum(1).gt(0).tolist() == [True, True, True, True]

    compiled = torch.compile(model, fullgraph=True)
    compiled_logits, compiled_grads = _step(compiled, TOKEN_IDS)
    torch.testing.assert_close(compiled_logits, logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(input_ids=TOKEN_IDS).logits, logits, rtol=1e-5, atol=1e-5)


def test_trainable_tokens_on_host_tables_are_fetched_ahead_with_the_resident_outputs(monkeypatch):
    """With the tables in host memory (served as a model on an accelerator serves them, the ids on the CPU here), the
    tables' rows are fetched as a plain table's (a small inference forward's all at once, a training forward's ahead
    by the worker), and the trained rows go in after: the resident logits and gradients."""
    model = _token_model().train()
    logits, grads = _step(model, TOKEN_IDS)
    fetched, fetch, at_once = [], StemTableRows._fetch, StemTableRows._fetch_at_once
    monkeypatch.setattr(StemTableRows, "host_served", lambda self, table: True)
    monkeypatch.setattr(StemTableRows, "_fetch_at_once", lambda self: fetched.append("at once") or at_once(self))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=TOKEN_IDS).logits, logits, rtol=0, atol=0)
    assert fetched == ["at once"]
    fetched.clear()
    monkeypatch.setattr(modeling_stem, "HOST_AT_ONCE_MAX_IDS", 0)  # inference forwards fetched ahead too
    monkeypatch.setattr(
        StemTableRows, "_fetch", lambda self, table, *args: fetched.append(table) or fetch(self, table, *args)
    )
    host_logits, host_grads = _step(model.train(), TOKEN_IDS)
    tables = [m.token_adapter.base_layer for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    assert fetched == tables and all(type(t) is StemTable for t in tables)
    torch.testing.assert_close(host_logits, logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(host_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=TOKEN_IDS).logits, logits, rtol=0, atol=0)
    assert fetched[2:] == tables


def test_train_casts_the_trained_rows_to_float32_and_leaves_the_table_peft_freezes_as_stored():
    """bf16 tables and bf16 trained rows (PEFT keeps an adapter's dtype with `autocast_adapter_dtype=False`): `train()`
    casts the trained rows, which train, to float32, never the frozen table (it cast the whole table before, as if the
    table trained), and the outputs are PEFT's own."""
    torch.manual_seed(0)
    base = tiny_model(table_dtype="bfloat16")
    model = get_peft_model(base, lora_config(base, r=4, token_ids=ROWS), autocast_adapter_dtype=False)
    wrappers = [m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    assert len(wrappers) == 2
    assert all(w.token_adapter.trainable_tokens_delta["default"].dtype == torch.bfloat16 for w in wrappers)
    model.train()
    for wrapper in wrappers:
        assert wrapper.token_adapter.base_layer.weight.dtype == torch.bfloat16
        assert wrapper.token_adapter.trainable_tokens_delta["default"].dtype == torch.float32
    logits, grads = _step(model, TOKEN_IDS)
    expected_logits, expected = _with_peft_forward(model, lambda: _step(model, TOKEN_IDS))
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_an_optimizer_that_decays_the_rows_peft_trains_is_named_once(caplog):
    """A plain Trainer's AdamW decays PEFT's trained rows (they are neither norms nor biases), which shrinks every
    trained row at each step, its token in the batch or not: named once, as for a table. `param_groups` keeps them
    out of decay: no warning."""
    from transformers.utils import logging

    from stem_hf.training import param_groups

    model = _token_model().train()
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.endswith("stem_tables.1.weight"))
    logger = logging.get_logger("stem_hf.modeling_stem")
    plain = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    grouped = torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.1), lr=1e-3)
    warned = []
    with caplog.at_level("WARNING", logger=logger.name):
        for optimizer in (grouped, plain, plain):
            _step(model, TOKEN_IDS)
            optimizer.step()
            warned.append(caplog.text.count("applies weight_decay=0.1 to STEM tables (or to the rows PEFT trains"))
    assert warned == [0, 1, 1]
    assert "dense gradients" not in caplog.text  # rows, not a [vocab, d_ff] table


@pytest.mark.parametrize("peft_kwargs", [{"token_ids": ROWS}, {"modules_to_save": ["stem_tables.1"]}])
def test_the_offload_engine_refuses_tables_peft_wraps_and_serves_the_merged_model(peft_kwargs):
    """The engine serves a copy of the tables' rows, which would not follow an adapter: it refuses a PEFT model and a
    model whose tables PEFT wraps, naming the way out, and serves the merged model's logits."""
    from stem_hf.offload import StemOffloadEngine

    base = _base()
    model = get_peft_model(base, lora_config(base, r=4, **peft_kwargs)).eval()
    with pytest.raises(ValueError, match=r"PeftModelForCausalLM is not a STEM model .*merge_and_unload\(\)"):
        StemOffloadEngine(model)
    with pytest.raises(ValueError, match=r"STEM tables \{'1': '.*Wrapper'.*\} are wrapped .*merge_and_unload\(\)"):
        StemOffloadEngine(model.base_model.model)
    merged = model.merge_and_unload()
    with torch.no_grad():
        expected = merged(input_ids=TOKEN_IDS).logits
        with StemOffloadEngine(merged):
            torch.testing.assert_close(merged(input_ids=TOKEN_IDS).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("wrapped", [True, False])
def test_persisted_edits_and_injections_refuse_tables_peft_wraps(wrapped):
    """A persisted edit or an injection writes the tables' rows: through PEFT's wrapper, a write went to a merged copy
    and was lost. Both refuse a model whose tables PEFT wraps, and a PEFT model, naming the way out. An editor writes
    nothing (it points ids elsewhere): it serves the wrapped model, trained rows included."""
    from stem_hf.editing import StemEdit, StemEditor, persist_edit, persisted
    from stem_hf.injection import inject_fact

    model = _token_model().eval()
    target = model.base_model.model if wrapped else model
    problem = "STEM tables .* are wrapped" if wrapped else "PeftModelForCausalLM is not a STEM model"
    edit = StemEdit(source=(7,), target=(ROWS[1],))  # onto a trained row
    with pytest.raises(ValueError, match=rf"persist_edit: {problem}.*merge_and_unload\(\)"):
        persist_edit(target, edit)
    with pytest.raises(ValueError, match=rf"persisted: {problem}.*merge_and_unload\(\)"), persisted(target, edit):
        pass
    with pytest.raises(ValueError, match=rf"inject_fact: {problem}.*merge_and_unload\(\)"):
        inject_fact(target, None, ["a fact"], 11)
    if wrapped:
        with torch.no_grad():
            expected = model(input_ids=TOKEN_IDS, stem_input_ids=TOKEN_IDS.where(TOKEN_IDS != 7, ROWS[1])).logits
            assert not torch.allclose(expected, model(input_ids=TOKEN_IDS).logits)
            with StemEditor(target, [edit]):
                torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, expected, rtol=0, atol=0)


def test_the_wrapper_check_takes_a_checkpoint_loaded_with_its_own_code(tmp_path):
    """A checkpoint loaded with trust_remote_code brings its own copy of the model's classes: the check refuses PEFT's
    wrappers, not tables of another class."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from stem_hf.editing import StemEdit, persist_edit
    from stem_hf.offload import StemOffloadEngine

    _base().save_pretrained(tmp_path)
    remote = get_class_from_dynamic_module("modeling_stem.StemForCausalLM", str(tmp_path))  # what auto_map names
    model = remote.from_pretrained(tmp_path).eval()
    assert type(model).__module__.startswith("transformers_modules.")
    with torch.no_grad(), StemOffloadEngine(model):
        model(input_ids=TOKEN_IDS)
    persist_edit(model, StemEdit(source=(7,), target=(ROWS[1],)))
    torch.testing.assert_close(model.model.stem_tables["1"].weight[7], model.model.stem_tables["1"].weight[ROWS[1]])


@torch.no_grad()
def test_the_trained_ids_cross_to_the_device_once_per_adapter_not_per_layer_and_step():
    """The sorted trained ids are made from the host's list (on an accelerator, a copy that waits for the device) once
    per adapter's rows and device and kept: decoding steps reuse them; other ids under the same rows are remade."""
    model = _token_model().eval()
    made = []
    tensor = torch.tensor
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_stem.torch, "tensor", lambda *a, **k: made.append(a[0]) or tensor(*a, **k))
        model.generate(TOKEN_IDS[:1], max_new_tokens=4, do_sample=False)
        assert made.count(ROWS) == 2  # one per STEM table's rows, for the prompt and every step after
        wrapper = next(m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper")
        wrapper.token_adapter.token_indices["default"] = [9, 40, 5]  # the same rows, other ids
        model(input_ids=TOKEN_IDS)
        assert made.count([9, 40, 5]) == 1 and made.count(ROWS) == 2


def test_resizing_the_vocabulary_refuses_tables_peft_wraps():
    """New tables would replace PEFT's wrappers, dropping the trained rows: refused before anything changes."""
    model = _token_model().eval()
    with torch.no_grad():
        before = model(input_ids=TOKEN_IDS).logits
    with pytest.raises(ValueError, match=r"resize_token_embeddings: STEM tables .* are wrapped .*merge_and_unload"):
        model.resize_token_embeddings(128)
    assert model.get_input_embeddings().num_embeddings == 96
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=TOKEN_IDS).logits, before, rtol=0, atol=0)


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


@pytest.mark.parametrize("peft_kwargs", [{"token_ids": [40, 50]}, {"modules_to_save": ["stem_tables.1"]}])
def test_stem_trainer_trains_a_peft_model_with_dense_gradients_for_tables_peft_renames(tmp_path, peft_kwargs):
    """PEFT's copies of a table (trained rows, a whole copy) are named otherwise than `stem_tables.N.weight`, so
    `param_groups` puts them in a dense group of their own, at the tables' rate and decay; `StemTrainer`'s default
    leaves their gradients dense (a sparse one there would be refused)."""
    from transformers import TrainingArguments

    from stem_hf.training import StemTrainer

    base = _base()
    model = get_peft_model(base, lora_config(base, r=4, **peft_kwargs))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, learning_rate=1e-2, disable_tqdm=True)  # fmt: skip
    args.weight_decay = 0.1
    trainer = StemTrainer(model=model, args=args, train_dataset=_dataset(8), table_lr=3e-2)
    assert not trainer.sparse_table_grads
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 2
    # What PEFT trains of the tables trains as the tables do: at the tables' rate, without decay (which would shrink
    # every trained row at each step, its token in the batch or not), with dense gradients.
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    peft_tables = {id(p) for p in groups["peft_tables"]["params"]}
    named = [n for n, p in model.named_parameters() if id(p) in peft_tables]
    assert len(named) == (2 if "token_ids" in peft_kwargs else 1) and all(".stem_tables." in n for n in named), named
    assert groups["peft_tables"]["initial_lr"] == 3e-2 and groups["peft_tables"]["weight_decay"] == 0.0
    assert not groups["peft_tables"]["row_sparse"] and groups["decay"]["weight_decay"] == 0.1
    unchanged = [n for n, p in model.named_parameters() if id(p) in peft_tables and torch.equal(before[n], p)]
    assert not unchanged, unchanged
