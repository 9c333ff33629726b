"""Bad input to the model and config gets an error that names the problem; the transformers paths Llama passes
(`generate(inputs_embeds=...)`, assisted and chunked generation, PEFT prompt tuning, torch.compile, tensor
parallelism) work or fail clearly; trained tables do not lose their updates to bf16 rounding."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from peft import PromptTuningConfig, get_peft_model
from transformers import Trainer, TrainingArguments

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.editing import StemEdit, persist_edit
from tests.conftest import TINY, sensitive_model, tiny_config, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = torch.tensor([[1, 5, 6, 7, 9, 11, 13]])
# Other rows than the text's own at most positions: a lookup shifted by one position changes the answer.
EDITED = torch.tensor([[1, 60, 40, 70, 9, 50, 77]])


def greedy(model, n: int = 6, **kwargs) -> torch.Tensor:
    return model.generate(max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stem_layers": 3}, r"stem_layers: 3 is neither a list nor a string.*write \[3\]"),
        ({"vocab_size": 0}, "vocab_size: 0 must be a positive integer"),
        ({"vocab_size": "96"}, "vocab_size: '96' must be a positive integer"),
        ({"intermediate_size": -64}, "intermediate_size: -64 must be a positive integer"),
        ({"intermediate_size": 64.0}, "intermediate_size: 64.0 must be a positive integer"),
        ({"pad_token_id": 96}, r"pad_token_id: 96 is neither a token id in the vocabulary \[0, 96\)"),
        ({"pad_token_id": -97}, "pad_token_id: -97 is neither a token id"),
        # issue 35: sizes and numbers that built a model giving NaN, or failed deep in torch
        ({"num_key_value_heads": 0}, "num_key_value_heads: 0 must be a positive integer"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"head_dim": 0}, "head_dim: 0 must be a positive integer"),
        ({"max_position_embeddings": -3}, "max_position_embeddings: -3 must be a positive integer"),
        ({"vocab_size": 10**20}, r"vocab_size: 100000000000000000000 is larger than the largest size .*2147483647"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps: nan must be a positive finite number"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps: 0.0 must be a positive finite number"),
        ({"initializer_range": float("inf")}, r"initializer_range: inf must be a finite number >= 0"),
        ({"attention_dropout": 1.5}, r"attention_dropout: 1.5 must be a probability in \[0, 1\)"),
        ({"hidden_act": "swish2"}, "hidden_act: 'swish2' is not an activation transformers knows"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, r"rope_theta'\]: -1.0 must be a positive"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": float("nan")}},
            r"rope_parameters\['factor'\]: nan must be a positive finite number",
        ),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_empty_input_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids has shape \(1, 0\): no position to run"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(1, 0, 32\)"):
        model(inputs_embeds=torch.zeros(1, 0, 32), stem_input_ids=torch.zeros(1, 0, dtype=torch.long))


def test_a_load_cannot_change_which_tables_a_checkpoint_holds(tmp_path):
    tiny_model().save_pretrained(tmp_path)  # stem_layers [1, 3]
    with pytest.raises(ValueError, match=r"stem_layers='1/3'.*saved with stem_layers=\[1, 3\]"):
        StemForCausalLM.from_pretrained(tmp_path, stem_layers="1/3")
    with pytest.raises(ValueError, match="intermediate_size=128"):
        StemForCausalLM.from_pretrained(tmp_path, intermediate_size=128)
    same = StemForCausalLM.from_pretrained(tmp_path, stem_layers="1/2")  # 1/2 of 4 layers is [1, 3]: allowed
    assert same.config.stem_layers == [1, 3]


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


def test_an_out_of_range_id_under_torch_compile_fails_and_generate_names_it():
    # Issue 36: a compiled forward does not check ids (a host sync, and a graph break under fullgraph=True); the lookup
    # fails as Llama's does. generate checks its prompt before any compiled step.
    model = tiny_model()
    compiled = torch.compile(model, backend="eager")
    with pytest.raises((IndexError, RuntimeError), match="index out of range"):
        compiled(torch.tensor([[1, 500]]))
    with pytest.raises(ValueError, match=r"input_ids holds token id 500, outside \[0, 96\)"):
        model.generate(torch.tensor([[1, 500]]), max_new_tokens=1)
    with pytest.raises(ValueError, match=r"input_ids holds token id 500, outside \[0, 96\)"):
        model(torch.tensor([[1, 500]]))  # an eager forward still checks


def _plan_matches(plan: dict, names: set[str]) -> dict:
    import re

    generic = {re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), n) for n in names}
    return {key: key in generic for key in plan}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_tensor_parallel_plan_names_real_modules_and_covers_every_matrix_of_the_layers(qk_norm):
    model = tiny_model(qk_norm=qk_norm)
    plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()} | model._tp_plan
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    assert all(_plan_matches(plan, names).values()), _plan_matches(plan, names)
    covered = {key.removesuffix(".weight") for key in plan}
    for name, param in model.named_parameters():
        if param.ndim == 2 and name != "model.embed_tokens.weight":
            generic = ".".join("*" if part.isdigit() else part for part in name.split("."))
            assert generic.removesuffix(".weight") in covered, name
    assert plan["model.stem_tables.*.weight"] == "embedding_colwise"  # [vocab, d_ff] split along d_ff, like up_proj
    assert set(model.config.base_model_pp_plan) == {"embed_tokens", "layers", "norm"}
    assert json.loads(model.config.to_json_string()).get("base_model_tp_plan") is None  # a class setting, not saved


TP_SCRIPT = """
import sys, torch, torch.distributed as dist
from stem_hf import StemForCausalLM
model = StemForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto")
ids = torch.tensor([[1, 5, 6, 7, 9, 11]])
with torch.no_grad():
    logits = model(ids).logits
weight = model.model.stem_tables["1"].weight
model.train()
model(ids, labels=ids).loss.backward()
if dist.get_rank() == 0:
    torch.save({"logits": logits, "local": tuple(weight.to_local().shape), "placements": str(weight.placements),
                "grad": weight.grad is not None}, sys.argv[2])
"""


@pytest.mark.slow
def test_tp_plan_auto_shards_the_tables_along_intermediate_size_and_matches_one_process(tmp_path):
    model = tiny_model(table_dtype="float32")
    model.save_pretrained(tmp_path / "ck")
    with torch.no_grad():
        reference = model(torch.tensor([[1, 5, 6, 7, 9, 11]])).logits
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    run = subprocess.run(
        [*command, str(tmp_path / "ck"), str(tmp_path / "out.pt")], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "were not sharded" not in run.stderr and "match nothing" not in run.stderr
    out = torch.load(tmp_path / "out.pt")
    assert out["local"] == (96, 32) and "Shard(dim=1)" in out["placements"] and out["grad"]
    assert torch.allclose(out["logits"], reference, atol=1e-5)


def _touched_fraction_changed(model, steps: int = 3, lr: float = 1e-5) -> float:
    """Plain Trainer, default arguments but the learning rate: the share of the batch's table values that moved."""
    rows = torch.unique(IDS[0, :-1])  # the last position predicts nothing: its row gets no gradient
    before = {k: t.weight[rows].float().clone() for k, t in model.model.stem_tables.items()}
    data = [{"input_ids": IDS[0], "labels": IDS[0]}] * steps
    args = TrainingArguments(
        output_dir="/tmp/unused", per_device_train_batch_size=1, learning_rate=lr, max_steps=steps, report_to=[]
    )
    args = args.set_save(strategy="no").set_logging(strategy="no")
    Trainer(model=model, args=args, train_dataset=data).train()
    moved = [(t.weight[rows].float() != before[k]).float().mean() for k, t in model.model.stem_tables.items()]
    return float(sum(moved) / len(moved))


def test_a_plain_trainer_fine_tunes_bf16_tables_in_float32_and_saves_every_update(tmp_path):
    model = tiny_model(table_dtype="bfloat16")
    torch.nn.init.normal_(model.model.stem_tables["1"].weight, std=1.0)  # values whose bf16 spacing dwarfs 1e-5 steps
    torch.nn.init.normal_(model.model.stem_tables["3"].weight, std=1.0)
    model.save_pretrained(tmp_path / "ck")
    loaded = StemForCausalLM.from_pretrained(tmp_path / "ck")
    assert loaded.model.stem_tables["1"].weight.dtype == torch.bfloat16
    assert _touched_fraction_changed(loaded) > 0.9
    assert loaded.model.stem_tables["1"].weight.dtype == torch.float32
    assert loaded.config.table_dtype == "float32"  # so that the save keeps every update
    loaded.save_pretrained(tmp_path / "tuned")
    reread = StemForCausalLM.from_pretrained(tmp_path / "tuned")
    assert reread.model.stem_tables["1"].weight.dtype == torch.float32
    assert torch.equal(reread.model.stem_tables["1"].weight, loaded.model.stem_tables["1"].weight)

    kept = StemForCausalLM.from_pretrained(tmp_path / "ck")
    kept.model.stem_tables.upcast_for_training = False  # the old path: tables trained as stored
    assert _touched_fraction_changed(kept) < 0.1


def test_frozen_tables_stay_as_stored_and_bf16_training_warns(caplog):
    model = tiny_model(table_dtype="bfloat16")
    model.model.stem_tables.requires_grad_(False)
    model.train()
    assert model.model.stem_tables["1"].weight.dtype == torch.bfloat16
    model.model.stem_tables.requires_grad_(True)
    model.model.stem_tables.upcast_for_training = False
    model.train()
    from transformers.utils import logging

    logging.get_logger("stem_hf.modeling_stem").warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        model(IDS, labels=IDS).loss.backward()
    assert "training STEM tables in bfloat16" in caplog.text


def test_an_optimizer_that_decays_tables_is_named_once(caplog):
    model = tiny_model(table_dtype="float32").train()
    decayed = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model(IDS, labels=IDS).loss.backward()
    with caplog.at_level("WARNING"):
        decayed.step()
        decayed.step()
    assert caplog.text.count("applies weight_decay=0.1 to STEM tables") == 1


def test_a_plain_trainer_resumes_a_bf16_checkpoint_whose_tables_it_upcast(tmp_path):
    tiny_model(table_dtype="bfloat16").save_pretrained(tmp_path / "ck")
    data = [{"input_ids": IDS[0], "labels": IDS[0]}] * 4
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=1, max_steps=2, report_to=[], save_steps=2
    )
    Trainer(model=StemForCausalLM.from_pretrained(tmp_path / "ck"), args=args, train_dataset=data).train()
    args.max_steps = 4  # the optimizer state comes back before train() upcasts the tables
    resumed = Trainer(model=StemForCausalLM.from_pretrained(tmp_path / "ck"), args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.state.global_step == 4


def test_under_torch_distributed_train_leaves_tables_and_upcast_trainable_casts_them(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_model(table_dtype="bfloat16").train()
        assert model.model.stem_tables["1"].weight.dtype == torch.bfloat16  # a wrapped model could not change it
        assert model.model.stem_tables.upcast_trainable() == ["1", "3"]  # before wrapping: the caller's call
        assert model.model.stem_tables["1"].weight.dtype == torch.float32
    finally:
        torch.distributed.destroy_process_group()


def test_training_or_editing_unties_a_model_from_its_checkpoint_and_a_save_ties_it_again(tmp_path):
    from stem_hf.checkpoint_stem import provenance_matches, read_save_id

    tiny_model().save_pretrained(tmp_path)
    model = StemForCausalLM.from_pretrained(tmp_path)
    assert model.stem_save_id == read_save_id(tmp_path)
    model.train()
    assert not provenance_matches({"stem_save_id": model.stem_save_id}, tmp_path)  # results of it quote no checkpoint
    edited = StemForCausalLM.from_pretrained(tmp_path)
    persist_edit(edited, StemEdit((10,), (11,)))
    assert not provenance_matches({"stem_save_id": edited.stem_save_id}, tmp_path)
    edited.save_pretrained(tmp_path / "edited")
    assert edited.stem_save_id == read_save_id(tmp_path / "edited")


def test_a_row_sparse_optimizer_keeps_its_float32_state_on_tables_trained_as_stored():
    from stem_hf.training import RowSparseAdamW, param_groups

    model = tiny_model(table_dtype="bfloat16")
    model.model.stem_tables.upcast_for_training = False
    model.train()
    for row_sparse in (False, True):
        optimizer = RowSparseAdamW(param_groups(model, 1e-3, row_sparse_tables=row_sparse))
        for _ in range(3):
            model(IDS, labels=IDS).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        states = [optimizer.state[t.weight] for t in model.model.stem_tables.values()]
        assert all(v.dtype == torch.float32 for s in states for v in s.values() if torch.is_floating_point(v))


def test_with_frozen_tables_beside_trained_ones_the_config_keeps_the_stored_dtype(tmp_path, caplog):
    model = tiny_model(table_dtype="bfloat16")
    model.model.stem_tables["3"].requires_grad_(False)
    model.train()
    assert model.model.stem_tables["1"].weight.dtype == torch.float32
    assert model.model.stem_tables["3"].weight.dtype == torch.bfloat16
    assert model.config.table_dtype == "bfloat16"  # the frozen table is not doubled on disk
    from transformers.utils import logging

    logging.get_logger("stem_hf.modeling_stem").warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        model.save_pretrained(tmp_path)
    assert "tables held in float32" in caplog.text  # the rounding of the trained one is said


def test_a_config_saved_again_as_it_was_loaded_does_not_claim_the_old_save(tmp_path):
    tiny_model().save_pretrained(tmp_path / "a")
    model = StemForCausalLM.from_pretrained(tmp_path / "a")
    assert not hasattr(model.config, "stem_save_id")
    model.save_pretrained(tmp_path / "b")
    model.config.save_pretrained(tmp_path / "b")  # a config refreshed by hand after the save
    StemForCausalLM.from_pretrained(tmp_path / "b")


def test_negative_pad_ids_index_from_the_end_as_torch_takes_them():
    assert tiny_config(pad_token_id=-1).pad_token_id == -1
    assert tiny_model(pad_token_id=-1).model.embed_tokens.padding_idx == 95


class WordTokenizer:
    """The parts of a word-level tokenizer with an unknown token that `StemEdit.from_text` uses."""

    unk_token, unk_token_id = "[UNK]", 3
    words = {" France": 10, " Germany": 11, " Paris": 12}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.words.get(" " + w, self.unk_token_id) for w in text.split()]}


def test_an_edit_of_an_unknown_word_or_of_one_token_twice_is_refused():
    with pytest.raises(ValueError, match=r"' Atlantis' holds a word the tokenizer maps to its unknown token '\[UNK\]'"):
        StemEdit.from_text(WordTokenizer(), " Atlantis", " Germany")
    with pytest.raises(ValueError, match="target ' Xanadu' holds a word"):
        StemEdit.from_text(WordTokenizer(), " France", " Xanadu")
    model = tiny_model()
    before = model.model.stem_tables["1"].weight.clone()
    with pytest.raises(ValueError, match=r"source token 10 occurs twice in \[10, 10\].*rows of both 11 and 12"):
        persist_edit(model, StemEdit((10, 10), (11, 12)))
    assert torch.equal(model.model.stem_tables["1"].weight, before)  # refused before any write
    persist_edit(model, StemEdit((10, 10), (11, 12), "mean"))  # one row for both: no conflict


def test_stem_config_keeps_llama_fields_valid_for_dense_sources():
    from transformers import LlamaConfig

    from stem_hf.conversion.sources import stem_config_from_dense

    dense = LlamaConfig(**{**TINY, "pad_token_id": -1})
    assert stem_config_from_dense(dense, "1/2").pad_token_id is None  # "-1: no pad token" in some Llama configs
    assert isinstance(StemConfig(**TINY), StemConfig)
