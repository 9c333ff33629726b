import math

import pytest
import torch
import torch.nn.functional as F

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.accounting import flops_per_token, num_active_parameters, num_dense_parameters, num_table_parameters
from stem_hf.demo import PAPER_1B
from stem_hf.modeling_stem import StemMLP, StemTable, StemTableMLP, StemTableRows
from tests.conftest import TINY, sensitive_model, tiny_config, tiny_model


def _capture_mlp_io(layer):
    seen = {}

    def hook(module, args, output):
        seen["args"], seen["output"] = args, output

    return seen, layer.mlp.register_forward_hook(hook)


def test_layer_layout():
    model = tiny_model()
    assert model.config.stem_layers == [1, 3]
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, StemTableMLP if i in (1, 3) else StemMLP)
        assert hasattr(layer.mlp, "up_proj") == (i not in (1, 3))
    names = {n for n, _ in model.named_parameters()}
    assert {"model.stem_tables.1.weight", "model.stem_tables.3.weight"} <= names
    assert model.model.stem_tables["1"].weight.shape == (TINY["vocab_size"], TINY["intermediate_size"])
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.down_proj.weight" in names


def test_stem_layer_is_down_silu_gate_times_table_row():
    model = tiny_model()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 7))
    layer = model.model.layers[3]
    seen, handle = _capture_mlp_io(layer)
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    x = seen["args"][0]
    W_g, W_d = layer.mlp.gate_proj.weight, layer.mlp.down_proj.weight
    U = model.model.stem_tables["3"].weight
    expected = (F.silu(x @ W_g.T) * U[input_ids]) @ W_d.T
    assert torch.allclose(seen["output"], expected, atol=1e-6, rtol=0)


def test_stem_input_ids_replace_only_the_lookups():
    model = tiny_model()
    input_ids = torch.randint(3, TINY["vocab_size"], (1, 6))
    edited = input_ids.clone()
    edited[0, 2] = 5
    layer = model.model.layers[1]
    seen, handle = _capture_mlp_io(layer)
    with torch.no_grad():
        same = model(input_ids, stem_input_ids=input_ids).logits
        base = model(input_ids).logits
        out = model(input_ids, stem_input_ids=edited).logits
    handle.remove()
    assert torch.equal(same, base)
    assert torch.equal(seen["args"][1], model.model.stem_tables["1"].weight[edited])
    # Positions before the edit see nothing of it (causal), the edited position does.
    assert torch.equal(out[0, :2], base[0, :2])
    assert not torch.allclose(out[0, 2], base[0, 2])


def test_inputs_embeds_with_stem_input_ids_equals_input_ids():
    model = tiny_model()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 5))
    with torch.no_grad():
        expected = model(input_ids).logits
        actual = model(inputs_embeds=model.model.embed_tokens(input_ids), stem_input_ids=input_ids).logits
    assert torch.equal(expected, actual)


def test_tables_init_xavier_normal_and_get_dense_gradients():
    config = tiny_config(vocab_size=512, intermediate_size=256)
    model = StemForCausalLM(config)
    table = model.model.stem_tables["1"]
    assert isinstance(table, StemTable) and not table.sparse
    expected_std = math.sqrt(2 / (512 + 256))
    assert abs(table.weight.std().item() - expected_std) / expected_std < 0.02
    input_ids = torch.randint(10, 20, (2, 8))
    model(input_ids, labels=input_ids).loss.backward()
    grad = table.weight.grad
    assert grad is not None and grad.layout == torch.strided
    touched = grad.abs().sum(-1) > 0
    assert touched[10:20].any() and not touched[:10].any() and not touched[20:].any()


def test_loss_function_takes_num_items_in_batch():
    model = tiny_model()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 6))
    mean = model(input_ids, labels=input_ids).loss
    summed = model(input_ids, labels=input_ids, num_items_in_batch=torch.tensor(1)).loss
    assert torch.allclose(summed, mean * 10)  # 2 x 5 shifted labels


def test_logits_to_keep():
    model = tiny_model()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 6))
    with torch.no_grad():
        full = model(input_ids).logits
        last = model(input_ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, TINY["vocab_size"]) and torch.allclose(last[:, 0], full[:, -1], atol=1e-6)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_greedy_generate_with_cache_equals_without(attn_implementation):
    model = tiny_model(attn_implementation=attn_implementation)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 5))
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(input_ids))
    with_cache = model.generate(input_ids, use_cache=True, **kwargs)
    without = model.generate(input_ids, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 17)
    assert torch.equal(with_cache, without)


def test_left_padded_batched_generation_equals_one_by_one():
    model = tiny_model()
    prompts = [torch.randint(3, TINY["vocab_size"], (n,)) for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), TINY["pad_token_id"])
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=TINY["pad_token_id"])
    batched = model.generate(input_ids, attention_mask=attention_mask, **kwargs)[:, width:]
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs)
        assert torch.equal(batched[row], alone[0, len(prompt) :]), row


def test_gradient_checkpointing_gives_same_gradients(monkeypatch):
    model = tiny_model().train()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    lookups = []
    gather = StemTableRows._rows  # the gather of a layer's rows, however the layer asks for them
    monkeypatch.setattr(StemTableRows, "_rows", lambda self, i, table: lookups.append(i) or gather(self, i, table))

    def grads():
        model.zero_grad()
        lookups.clear()
        model(input_ids, labels=input_ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    assert sorted(lookups) == [1, 3]
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = grads()
    assert sorted(lookups) == [1, 1, 3, 3]  # rows are gathered again in the recompute, not kept
    assert plain.keys() == checkpointed.keys() and "model.stem_tables.1.weight" in plain
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5), name


def test_bf16_forward_runs_and_stays_close_to_fp32():
    model = tiny_model()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    with torch.no_grad():
        fp32 = model(input_ids).logits
        bf16 = model.to(torch.bfloat16)(input_ids).logits
    assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16).all()
    assert (bf16.float() - fp32).abs().max().item() < 0.05


def test_rows_are_cast_not_the_table():
    model = tiny_model()
    for table in model.model.stem_tables.values():
        table.to(torch.bfloat16)
    input_ids = torch.randint(0, TINY["vocab_size"], (1, 6))
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.dtype == torch.float32 and model.model.stem_tables["1"].weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": torch.tensor([[3, 96]])}, r"input_ids holds token id 96, outside \[0, 96\): vocab_size is 96"),
        ({"input_ids": torch.tensor([[-1, 4]])}, r"input_ids holds token id -1, outside \[0, 96\)"),
        (
            {"input_ids": torch.tensor([[3, 4]]), "stem_input_ids": torch.tensor([[3, 1000]])},
            r"stem_input_ids holds token id 1000, outside \[0, 96\): vocab_size is 96",
        ),
        (
            {"input_ids": torch.tensor([[3, 4]]), "stem_input_ids": torch.tensor([[3, 4, 5]])},
            r"stem_input_ids has shape \(1, 3\) but the inputs have \(batch_size, sequence_length\) = \(1, 2\)",
        ),
        ({"inputs_embeds": torch.zeros(1, 2, 32)}, r"STEM layers \[1, 3\].*pass `stem_input_ids`"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_model()(**kwargs)


def test_inputs_embeds_alone_is_fine_without_stem_layers():
    model = tiny_model(stem_layers=[])
    with torch.no_grad():
        assert model(inputs_embeds=torch.zeros(1, 2, 32)).logits.shape == (1, 2, TINY["vocab_size"])


@pytest.mark.parametrize("mean_resizing", [True, False])
def test_resize_token_embeddings_resizes_tables(mean_resizing):
    model = tiny_model()
    old = {k: t.weight.detach().clone() for k, t in model.model.stem_tables.items()}
    model.resize_token_embeddings(100, mean_resizing=mean_resizing)
    assert model.config.vocab_size == 100
    for key, table in model.model.stem_tables.items():
        assert isinstance(table, StemTable) and table.weight.shape == (100, TINY["intermediate_size"])
        assert torch.equal(table.weight[:96], old[key])
        new_rows = table.weight[96:].detach()
        if mean_resizing:
            assert torch.allclose(new_rows, old[key].mean(0).expand(4, -1))
        else:
            assert not torch.allclose(new_rows[0], new_rows[1])
    with torch.no_grad():
        assert model(torch.tensor([[3, 99]])).logits.shape == (1, 2, 100)
    model.resize_token_embeddings(50)
    assert all(t.weight.shape[0] == 50 for t in model.model.stem_tables.values())
    with pytest.raises(ValueError, match="token id 60"):
        model(torch.tensor([[60]]))


def test_resized_model_saves_and_reloads(tmp_path):
    model = tiny_model()
    model.resize_token_embeddings(104)
    model.save_pretrained(tmp_path)
    reloaded = StemForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.tensor([[3, 103, 7]])
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reloaded(input_ids).logits)


def test_accounting_on_tiny_model():
    model = tiny_model(tie_word_embeddings=True)
    c = model.config
    table = c.vocab_size * c.intermediate_size
    assert num_table_parameters(model) == 2 * table
    assert num_active_parameters(model) == model.num_parameters() - 2 * table + 2 * c.intermediate_size
    assert num_dense_parameters(model) == model.num_parameters() - 2 * table + 2 * c.hidden_size * c.intermediate_size
    saved = flops_per_token(model.config, 16, dense=True) - flops_per_token(model.config, 16)
    assert saved == 2 * len(c.stem_layers) * c.hidden_size * c.intermediate_size


def test_saved_flop_fraction_matches_paper_formula():
    # Multi-head attention, one layer, no LM head: the paper's d_ff / (4d + 2L + 3 d_ff) per STEM layer.
    d, d_ff, L = 64, 256, 100
    config = StemConfig(
        vocab_size=1, hidden_size=d, intermediate_size=d_ff, num_hidden_layers=1, num_attention_heads=4, stem_layers=[0]
    )
    with torch.device("meta"):
        model = StemForCausalLM(config)
    dense, stem = flops_per_token(model.config, L, dense=True), flops_per_token(model.config, L)
    head = 2 * d  # the vocab-1 LM head
    assert math.isclose((dense - stem) / (dense - head), d_ff / (4 * d + 2 * L + 3 * d_ff))


def test_accounting_reproduces_paper_1b_sizes():
    # Llama-3.2-1B shape with untied head, as counted in the paper: dense 1.50B; STEM-1/3 1.41B active.
    config = StemConfig(**PAPER_1B, stem_layers="1/3")
    with torch.device("meta"):
        model = StemForCausalLM(config)
    assert config.stem_layers == [1, 4, 7, 10, 13]
    assert round(num_dense_parameters(model) / 1e9, 2) == 1.50
    assert round(num_active_parameters(model) / 1e9, 2) == 1.41
    assert round(num_table_parameters(model) / 1e9, 2) == 5.25


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_takes_stem_input_ids_for_the_prompt(use_cache):
    model = tiny_model()
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    kwargs = dict(max_new_tokens=5, do_sample=False, use_cache=use_cache, attention_mask=torch.ones_like(input_ids))
    plain = model.generate(input_ids, **kwargs)
    assert torch.equal(model.generate(input_ids, stem_input_ids=input_ids, **kwargs), plain)

    edited = input_ids.clone()
    edited[:, 2] = 7
    out = model.generate(input_ids, stem_input_ids=edited, output_logits=True, return_dict_in_generate=True, **kwargs)
    with torch.no_grad():  # each step equals a full forward whose lookups use the edited prompt, then the new tokens
        full_stem = torch.cat([edited, out.sequences[:, 6:]], dim=1)
        logits = model(out.sequences, stem_input_ids=full_stem).logits
    for step, step_logits in enumerate(out.logits):
        assert torch.allclose(step_logits, logits[:, 5 + step], atol=1e-5), step
    with torch.no_grad():
        assert not torch.allclose(out.logits[0], model(input_ids).logits[:, -1])  # the edit reached the prompt


def test_a_row_source_serves_every_stem_layer_and_is_handed_back():
    model = sensitive_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        before = model(ids).logits
        zeroed = sensitive_model()
        for table in zeroed.model.stem_tables.values():
            table.weight.zero_()
        expected = zeroed(ids).logits
    seen = []

    class ZeroRows:
        def __init__(self, ids):
            self.ids = ids

        def __getitem__(self, layer_idx):
            seen.append(layer_idx)
            return torch.zeros(*self.ids.shape, model.config.intermediate_size)

    assert model.model.set_row_source(ZeroRows) is None
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-6)
    assert seen == model.config.stem_layers  # each STEM layer asked once
    assert model.model.set_row_source(None) is ZeroRows  # handed back, to restore
    assert not [n for n in model.state_dict() if "row_source" in n]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


# Bad input gets a clear error; the generate paths Llama passes keep each position on its own row (issue 23).


IDS = torch.tensor([[1, 5, 6, 7, 9, 11, 13]])
# Other rows than the text's own at most positions: a lookup shifted by one position changes the answer.
EDITED = torch.tensor([[1, 60, 40, 70, 9, 50, 77]])


def greedy(model, n: int = 6, **kwargs) -> torch.Tensor:
    return model.generate(max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)


def test_empty_input_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids has shape \(1, 0\): no position to run"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(1, 0, 32\)"):
        model(inputs_embeds=torch.zeros(1, 0, 32), stem_input_ids=torch.zeros(1, 0, dtype=torch.long))


def test_generate_refuses_stem_ids_that_do_not_cover_the_prompt():
    model = tiny_model()
    for wrong in (EDITED[:, :4], torch.cat([EDITED, EDITED[:, :2]], dim=1), EDITED.repeat(2, 1)):
        with pytest.raises(ValueError, match="give one table id per prompt position"):
            greedy(model, input_ids=IDS, stem_input_ids=wrong)


def test_generate_takes_inputs_embeds_with_stem_ids_and_says_what_is_missing_without():
    model = sensitive_model(std=3.0, table_dtype="float32")
    embeds = model.get_input_embeddings()(IDS)
    from_ids = greedy(model, input_ids=IDS, stem_input_ids=EDITED)
    from_embeds = greedy(model, inputs_embeds=embeds, stem_input_ids=EDITED)
    assert torch.equal(from_embeds, from_ids[:, IDS.shape[1] :])  # generate returns only new tokens for embeds
    with pytest.raises(ValueError, match=r"generate\(inputs_embeds=...\).*pass `stem_input_ids`"):
        greedy(model, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="give the prompt as input_ids or as inputs_embeds, not both"):
        greedy(model, input_ids=IDS, inputs_embeds=embeds, stem_input_ids=EDITED)


def test_assisted_and_chunked_generation_keep_each_position_on_its_own_row():
    model, assistant = sensitive_model(std=3.0, table_dtype="float32"), tiny_model()
    plain = greedy(model, n=8, input_ids=IDS, stem_input_ids=EDITED)
    assert not torch.equal(plain, greedy(model, n=8, input_ids=IDS))  # the edited rows matter
    assisted = greedy(model, n=8, input_ids=IDS, stem_input_ids=EDITED, assistant_model=assistant)
    chunked = greedy(model, n=8, input_ids=IDS, stem_input_ids=EDITED, prefill_chunk_size=3)
    assert torch.equal(assisted, plain)
    assert torch.equal(chunked, plain)
