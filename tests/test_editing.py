"""Knowledge editing by table rows: the strategies' ids and rows, reversible edits, persisted edits through save and
reload, and clear errors."""

import contextlib

import pytest
import torch

from stem_hf import StemForCausalLM
from stem_hf.cli import main
from stem_hf.editing import StemEdit, StemEditor, edited, edited_ids, find_occurrences, persist_edit, persisted
from tests.conftest import _mapped_files, byte_tokenizer, sensitive_model, tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 9], [1, 5, 6, 3, 3, 3, 3]])


def test_occurrences_are_found_in_every_row():
    assert find_occurrences(IDS, [5, 6]) == [(0, 0), (0, 4), (1, 1)]
    assert find_occurrences(IDS, [6, 5]) == []
    assert find_occurrences(IDS[:, :1], [5, 6]) == []


@pytest.mark.parametrize(
    ("target", "strategy", "expected"),
    [
        ((20, 21), "clone", (20, 21)),  # equal lengths: position by position, every strategy
        ((20, 21), "filler", (20, 21)),
        ((20, 21), "subset", (20, 21)),
        ((20,), "clone", (20, 20)),  # shorter target: repeated
        ((20,), "filler", (20, 0)),  # shorter target: then the filler token
        ((20,), "subset", (20, 20)),
        ((20, 21, 22), "clone", (20, 21)),  # longer target: cut
        ((20, 21, 22), "filler", (20, 21)),
        ((20, 21, 22), "subset", (20, 22)),  # longer target: first and last
    ],
)
def test_id_strategies_point_each_source_position_at_a_target_token(target, strategy, expected):
    edit = StemEdit((5, 6), target, strategy, filler=0)
    assert edit.mapped_target() == expected
    out = edited_ids(IDS, [edit])
    assert out[0, :2].tolist() == list(expected) and out[0, 4:6].tolist() == list(expected)
    assert out[1, 1:3].tolist() == list(expected)
    untouched = torch.ones_like(IDS, dtype=torch.bool)
    untouched[0, :2] = untouched[0, 4:6] = untouched[1, 1:3] = False
    assert torch.equal(out[untouched], IDS[untouched])


def test_subset_of_a_long_target_spreads_over_it():
    assert StemEdit((1, 2, 3), (10, 11, 12, 13, 14), "subset").mapped_target() == (10, 12, 14)


@pytest.mark.parametrize("target", [(20,), (20, 21), (20, 21, 22)])
def test_mean_gives_every_source_position_the_mean_target_row(target):
    model = sensitive_model(table_dtype="float32")
    captured = {}
    layer = model.model.layers[1].mlp
    hook = layer.register_forward_pre_hook(lambda m, args: captured.update(rows=args[1]))
    with torch.no_grad(), StemEditor(model, [StemEdit((5, 6), target, "mean")]):
        model(IDS)
    hook.remove()
    table = model.model.stem_tables["1"].weight
    mean = table[list(target)].mean(dim=0)
    rows = captured["rows"]
    for r, c in [(0, 0), (0, 1), (0, 4), (0, 5), (1, 1), (1, 2)]:
        torch.testing.assert_close(rows[r, c], mean)
    torch.testing.assert_close(rows[0, 2], table[7])  # elsewhere: the text's own rows


def test_an_edit_changes_logits_and_leaving_it_restores_them_exactly():
    model = sensitive_model(table_dtype="float32")
    with torch.no_grad():
        before = model(IDS).logits
        with StemEditor(model, [StemEdit((5, 6), (30, 31), "clone")]):
            during = model(IDS).logits
            via_ids = model(IDS, stem_input_ids=edited_ids(IDS, [StemEdit((5, 6), (30, 31))])).logits
        after = model(IDS).logits
    assert not torch.allclose(during, before)
    torch.testing.assert_close(during, via_ids, rtol=0, atol=0)  # the hook is the per-call path
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(during[1, 0], before[1, 0], rtol=0, atol=0)  # before the source: unchanged


def test_an_edit_works_inside_generate():
    model = sensitive_model(table_dtype="float32")
    prompt = IDS[:1]
    plain = model.generate(prompt, max_new_tokens=5, do_sample=False)
    with StemEditor(model, [StemEdit((5, 6), (40, 41), "clone")]):
        changed = model.generate(prompt, max_new_tokens=5, do_sample=False)
    by_ids = model.generate(prompt, stem_input_ids=edited_ids(prompt, [StemEdit((5, 6), (40, 41))]), max_new_tokens=5)
    assert torch.equal(changed, by_ids) and not torch.equal(changed, plain)


def test_a_persisted_edit_survives_save_and_reload(tmp_path):
    model = sensitive_model(table_dtype="bfloat16")
    edit = StemEdit((5,), (30, 31), "mean")
    with torch.no_grad():
        expected_row = model.model.stem_tables["3"].weight[[30, 31]].float().mean(0).to(torch.bfloat16)
        persist_edit(model, edit)
        edited_logits = model(IDS).logits
    torch.testing.assert_close(model.model.stem_tables["3"].weight[5], expected_row, rtol=0, atol=0)
    model.save_pretrained(tmp_path / "edited")
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "edited")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, edited_logits, rtol=0, atol=0)


def test_a_persisted_edit_on_a_memory_mapped_model_never_alters_its_file(tmp_path):
    sensitive_model(table_dtype="bfloat16").save_pretrained(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "stem-tables-00001-of-00001.safetensors"
    before = shard.read_bytes()
    loaded = StemForCausalLM.from_pretrained(tmp_path / "ckpt")
    table = loaded.model.stem_tables["1"].weight
    assert any(f.endswith(".safetensors") for f in _mapped_files(table))  # the table is a view on the file
    persist_edit(loaded, StemEdit((5, 6), (7, 8)))
    assert torch.equal(table[5], table[7]) and torch.equal(table[6], table[8])  # the edit took
    assert shard.read_bytes() == before


def test_bad_edits_are_clear_errors():
    tokenizer = byte_tokenizer()
    with pytest.raises(ValueError, match="source string '' is empty"):
        StemEdit.from_text(tokenizer, "", "x")
    with pytest.raises(ValueError, match="target string ' ' is empty"):
        StemEdit.from_text(tokenizer, "x", " ")
    with pytest.raises(ValueError, match="strategy: 'swap'"):
        StemEdit((1,), (2,), "swap")
    with pytest.raises(ValueError, match=r"source tokens \[50, 51\] do not occur in the input"):
        edited_ids(IDS, [StemEdit((50, 51), (2,))])
    model = sensitive_model()
    with pytest.raises(ValueError, match=r"source tokens \[50, 51\] do not occur in the input"):
        with StemEditor(model, [StemEdit((50, 51), (2,))]):
            model(IDS)
    with pytest.raises(ValueError, match="token id 500 is outside the vocabulary"):
        StemEditor(model, [StemEdit((5,), (500,))])
    with pytest.raises(ValueError, match="no STEM layers"):
        StemEditor(tiny_model(stem_layers=[]), [StemEdit((5,), (6,))])


def test_text_edits_and_the_cli_print_answers_before_and_after(tmp_path, capsys):
    model = sensitive_model(vocab_size=259, max_position_embeddings=128)
    tokenizer = byte_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    with edited(model, tokenizer, "cat", "dog") as editor:
        assert editor.edits[0].source == tuple(tokenizer("cat", add_special_tokens=False).input_ids)
    main(["edit", str(tmp_path / "m"), "--source", "cat", "--target", "dog", "--prompt", "the cat sat", "-n", "4"])
    out = capsys.readouterr().out
    source, target = (
        tokenizer("cat", add_special_tokens=False).input_ids,
        tokenizer("dog", add_special_tokens=False).input_ids,
    )
    assert f"(tokens {source} -> {target})" in out and "before:" in out and "after (clone):" in out


def test_the_edit_evaluation_reports_each_strategy_and_restores_the_tables():
    from stem_hf.edit_eval import CAPITALS, evaluate_edits

    assert len(CAPITALS) >= 30 and len({s for s, _ in CAPITALS}) == len(CAPITALS)
    model = sensitive_model(vocab_size=259, max_position_embeddings=128)
    before = {k: t.weight.detach().clone() for k, t in model.model.stem_tables.items()}
    result = evaluate_edits(model, byte_tokenizer(), pairs=CAPITALS[:4], locality_prompts=2, new_tokens=2)
    assert set(result["strategies"]) == {"clone", "filler", "subset", "mean"}
    for stats in result["strategies"].values():
        assert 0 <= stats["efficacy"] <= 1 and 0 <= stats["locality_persisted"] <= 1
        assert 0 <= stats["efficacy_score"] <= 1 and isinstance(stats["mean_logprob_gap_shift"], float)
        assert stats["examples"][0]["edit"] == "France -> Germany"
    for k, t in model.model.stem_tables.items():
        assert torch.equal(t.weight, before[k])  # persisted edits were undone


@pytest.mark.parametrize("engine", [False, True])
def test_id_edits_are_gathered_inside_the_layers_kernel_where_the_config_fuses_lookups(engine):
    """With `fused_table_lookup`, an editor of id edits hands each STEM layer what its source's `lookup` gives (the
    table and the edited ids, or an engine's distinct rows), so the layer gathers the edited rows inside its own
    kernel; a `mean` edit's overridden rows are handed over gathered. Logits and greedy tokens equal the unfused
    editor's."""
    from stem_hf import modeling_stem
    from stem_hf.offload import offloaded

    model = sensitive_model(table_dtype="float32")
    clone, mean = StemEdit((5, 6), (30, 31), "clone"), StemEdit((5, 6), (30, 31), "mean")
    settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    fused, original = [], modeling_stem.fused_gated_lookup
    source = offloaded(model) if engine else contextlib.nullcontext()
    with pytest.MonkeyPatch.context() as patch, source, torch.no_grad():
        patch.setattr(
            modeling_stem, "fused_gated_lookup", lambda gate, rows: fused.append(rows) or original(gate, rows)
        )
        expected = {}
        for edit in (clone, mean):
            with StemEditor(model, [edit]):
                expected[edit.strategy] = model(IDS).logits, model.generate(IDS, **settings)
        assert fused == []  # on the CPU by default: rows
        model.config.fused_table_lookup = True
        for edit in (clone, mean):
            fused.clear()
            with StemEditor(model, [edit]):
                logits, tokens = model(IDS).logits, model.generate(IDS, **settings)
            torch.testing.assert_close(logits, expected[edit.strategy][0], rtol=0, atol=1e-5 * logits.abs().max())
            assert torch.equal(tokens, expected[edit.strategy][1])
            stem_layers = len(model.config.stem_layers)
            if edit is clone:  # every forward's every STEM layer: the prompt twice, then each decoding step
                assert len(fused) == stem_layers * (2 + 2) and all(
                    isinstance(f, modeling_stem.StemLookup) for f in fused
                )
                assert fused[0].index.shape == IDS.shape
            else:  # the prompt's overridden rows come gathered; decoding steps hold no source, so they fuse
                assert len(fused) == stem_layers * 2


def test_an_editor_over_an_offload_engine_edits_the_rows_the_engine_serves():
    from stem_hf.offload import StemOffloadEngine

    model = sensitive_model()
    ids = torch.tensor([[5, 6, 7, 8, 6, 7]])
    edit = StemEdit(source=(6, 7), target=(9, 10), strategy="clone")
    with torch.no_grad(), StemEditor(model, [edit]):
        alone = model(ids).logits
    with torch.no_grad(), StemOffloadEngine(model) as engine, StemEditor(model, [edit]):
        stacked = model(ids).logits
    assert engine.forwards == 1 and torch.allclose(stacked, alone, atol=1e-6)
    assert model.model.row_source is None  # both left: the model's own tables again


def test_row_sources_leave_in_the_order_they_came_and_an_editor_enters_once():
    from stem_hf.offload import StemOffloadEngine

    model = sensitive_model()
    edit = StemEdit(source=(6, 7), target=(9, 10), strategy="clone")
    editor, engine = StemEditor(model, [edit]), StemOffloadEngine(model)
    with editor:
        with pytest.raises(RuntimeError, match="attach the engine first"):
            engine.attach()  # it would serve its own store and drop the edits
        with pytest.raises(RuntimeError, match="already active"):
            editor.__enter__()
    assert model.model.row_source is None
    engine.attach()
    editor.__enter__()
    with pytest.raises(RuntimeError, match="leave it first"):
        engine.detach()  # the editor, set after it, still serves the rows
    assert model.model.row_source is editor
    editor.__exit__(None, None, None)
    engine.detach()
    assert model.model.row_source is None


def test_mean_edits_refuse_tables_the_offload_engine_freed():
    from stem_hf.offload import StemOffloadEngine

    model = sensitive_model()
    with StemOffloadEngine(model, free_tables=True), pytest.raises(ValueError, match="freed"):
        with StemEditor(model, [StemEdit(source=(6,), target=(9, 10), strategy="mean")]):
            pass


# Fault cases: persisted edits under an offload engine, which serves its own copy of the tables ------------------------

ENGINES = [{}, {"cache_tokens": 8}, {"int8": True, "cache_tokens": 8}, {"free_tables": True, "cache_tokens": 8}]
EDITS = [StemEdit((5, 6), (30, 31)), StemEdit((5,), (30, 31), "mean")]


def _reference(edit: StemEdit | None, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of IDS and of its first row's first 4 tokens from a plain model (or, int8, an engine built on it) with
    the edit persisted: what an engine must serve after the same edit."""
    from stem_hf.offload import offloaded

    plain = sensitive_model(table_dtype="float32")
    if edit is not None:
        persist_edit(plain, edit)
    with torch.no_grad(), offloaded(plain, int8=True) if int8 else contextlib.nullcontext():
        return plain(IDS).logits, plain(IDS[:1, :4]).logits


@pytest.mark.parametrize("edit", EDITS, ids=["clone", "mean"])
@pytest.mark.parametrize("kwargs", ENGINES, ids=["plain", "cache", "int8", "freed"])
def test_a_persisted_edit_reaches_the_rows_an_attached_engine_serves(kwargs, edit):
    from stem_hf.offload import StemOffloadEngine

    model = sensitive_model(table_dtype="float32")
    expected, expected_chunk = _reference(edit, kwargs.get("int8", False))
    with torch.no_grad(), StemOffloadEngine(model, **kwargs) as engine:
        before = model(IDS).logits  # with a cache: the source's rows are cached now
        if engine.cache is None:
            engine.plan(IDS[:1], chunk_size=4)  # the first chunk's rows are gathered ahead, before the edit
        persist_edit(model, edit)
        chunk = model(IDS[:1, :4]).logits
        after = model(IDS).logits
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    torch.testing.assert_close(chunk, expected_chunk, rtol=0, atol=0)
    if not kwargs.get("int8"):  # detached: the model's own tables, edited too (freed ones rebuilt from the copy)
        with torch.no_grad():
            torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=0)


def test_a_persisted_edit_reaches_an_engine_under_an_editor():
    from stem_hf.offload import StemOffloadEngine

    editor_edit, edit = StemEdit((7,), (40,)), StemEdit((5, 6), (30, 31))
    plain = sensitive_model(table_dtype="float32")
    persist_edit(plain, edit)
    with torch.no_grad(), StemEditor(plain, [editor_edit]):
        expected = plain(IDS).logits
    model = sensitive_model(table_dtype="float32")
    with torch.no_grad(), StemOffloadEngine(model, free_tables=True), StemEditor(model, [editor_edit]):
        persist_edit(model, edit)
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=0)


def test_persisted_undoes_its_edit_in_the_engine_too_exactly():
    from stem_hf.offload import StemOffloadEngine

    edit = EDITS[0]
    for kwargs in ENGINES:
        model = sensitive_model(table_dtype="float32")
        expected, _ = _reference(edit, kwargs.get("int8", False))
        with torch.no_grad(), StemOffloadEngine(model, **kwargs):
            before = model(IDS).logits
            with persisted(model, edit):
                during = model(IDS).logits
            after = model(IDS).logits
        torch.testing.assert_close(during, expected, rtol=0, atol=0, msg=f"{kwargs}")
        torch.testing.assert_close(after, before, rtol=0, atol=0, msg=f"{kwargs}")


def test_persisted_edits_refuse_an_engine_on_a_mapped_store_before_changing_anything(tmp_path):
    from stem_hf.offload import STORE_NAME, StemOffloadEngine, write_offload_store

    sensitive_model(table_dtype="bfloat16").save_pretrained(tmp_path / "ckpt")
    write_offload_store(tmp_path / "ckpt")
    model = StemForCausalLM.from_pretrained(tmp_path / "ckpt")
    table, save_id = model.model.stem_tables["1"].weight.clone(), model.stem_save_id
    message = r"memory-mapped offload store .*stem-offload-store.safetensors, which is never altered.*detach the engine"
    with StemOffloadEngine(model, store=tmp_path / "ckpt" / STORE_NAME):
        with pytest.raises(ValueError, match=message):
            persist_edit(model, EDITS[0])
        with pytest.raises(ValueError, match=message), persisted(model, EDITS[0]):
            pass
    assert torch.equal(model.model.stem_tables["1"].weight, table) and model.stem_save_id == save_id


def test_a_persisted_edit_names_tables_freed_by_an_engine_no_longer_attached():
    from stem_hf.offload import StemOffloadEngine

    model = sensitive_model()
    engine = StemOffloadEngine(model, free_tables=True)  # built, not attached: nothing serves the rows
    with pytest.raises(ValueError, match=r"freed by StemOffloadEngine\(free_tables=True\).*attach the engine"):
        persist_edit(model, EDITS[0])
    engine.detach()  # rebuilds the tables: the edit works again
    persist_edit(model, EDITS[0])


def test_a_mean_edit_into_an_int8_copy_of_freed_tables_is_close_to_the_exact_one():
    """With the tables freed, the int8 copy is the only one: a mean is taken over its dequantized rows, so it is close
    to, not exactly, the mean an int8 engine built from the edited tables holds."""
    from stem_hf.offload import StemOffloadEngine

    model = sensitive_model(table_dtype="float32")
    expected, _ = _reference(EDITS[1], int8=True)
    StemOffloadEngine(model, int8=True, free_tables=True, cache_tokens=8).attach()  # never detached: it refuses
    with torch.no_grad():
        before = model(IDS).logits
        persist_edit(model, EDITS[1])
        after = model(IDS).logits
    assert not torch.allclose(after, before, atol=0.05)
    torch.testing.assert_close(after, expected, rtol=0, atol=0.01 * expected.abs().max().item())


# Text edits that would write the wrong rows are refused (issue 23)


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


# The paper's strategies for unequal lengths, by the reference code's names: clone (its `copy`) and filler (its
# `right_pad`); `pad` is the old name of clone.


@pytest.mark.parametrize(
    ("source", "target", "clone", "filler"),
    [
        ((5, 6, 7), (20,), (20, 20, 20), (20, 0, 0)),  # n > m
        ((5, 6, 7), (20, 21), (20, 21, 20), (20, 21, 0)),
        ((5,), (20, 21, 22), (20,), (20,)),  # n < m: both keep the first n
        ((5, 6), (20, 21, 22), (20, 21), (20, 21)),
    ],
)
def test_clone_repeats_the_target_and_filler_fills_with_the_filler_token(source, target, clone, filler):
    ids = torch.tensor([[1, *source, 9, *source]])
    for strategy, expected in (("clone", clone), ("filler", filler)):
        out = edited_ids(ids, [StemEdit(source, target, strategy, filler=0)])
        assert out[0].tolist() == [1, *expected, 9, *expected], strategy


def test_pad_is_the_old_name_of_clone_and_warns():
    with pytest.warns(FutureWarning, match=r"'pad' is now called 'clone'.*filler token is 'filler'"):
        old = StemEdit((5, 6, 7), (20, 21), "pad")
    assert old == StemEdit((5, 6, 7), (20, 21), "clone") and old.mapped_target() == (20, 21, 20)
    with pytest.warns(FutureWarning, match="'clone'"):
        assert StemEdit.from_text(byte_tokenizer(), "cat", "do", "pad").strategy == "clone"


def test_filler_needs_a_filler_token_in_the_vocabulary():
    with pytest.raises(ValueError, match=r"strategy 'filler' needs the filler token's id \(StemEdit\(\.\.\., filler="):
        StemEdit((5, 6), (7,), "filler")
    with pytest.raises(ValueError, match="token id 500 is outside the vocabulary"):
        StemEditor(sensitive_model(), [StemEdit((5, 6), (7,), "filler", filler=500)])
    with pytest.raises(ValueError, match=r"strategy: 'swap' is not one of clone, filler, subset, mean"):
        StemEdit((1,), (2,), "swap")


class SpecialTokens(WordTokenizer):
    pad_token_id = eos_token_id = bos_token_id = None


@pytest.mark.parametrize(
    ("pad", "eos", "bos", "expected"), [(4, 5, 6, 4), (None, 5, 6, 5), (None, None, 6, 6), (0, None, None, 0)]
)
def test_from_text_fills_with_the_pad_token_else_eos_else_bos(pad, eos, bos, expected):
    tokenizer = SpecialTokens()
    tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id = pad, eos, bos
    edit = StemEdit.from_text(tokenizer, " France", " Germany Paris", "filler")
    assert edit.filler == expected and edit.mapped_target() == (11,)
    assert StemEdit.from_text(tokenizer, " France Paris", " Germany", "filler").mapped_target() == (11, expected)
    byte = byte_tokenizer()  # a real tokenizer, whose pad token is id 0
    do = tuple(byte("do", add_special_tokens=False).input_ids)
    assert StemEdit.from_text(byte, "cat", "do", "filler").mapped_target() == (*do, 0)


def test_from_text_names_a_tokenizer_with_no_filler_token():
    with pytest.raises(ValueError, match="no pad, eos or bos token"):
        StemEdit.from_text(SpecialTokens(), " France Paris", " Germany", "filler")
    assert StemEdit.from_text(SpecialTokens(), " France", " Germany").filler is None  # other strategies need none


def test_filler_gives_the_same_logits_per_call_in_an_editor_persisted_and_in_the_lab():
    from stem_hf.lab.measure import swapped_rows

    model = sensitive_model(table_dtype="float32")
    edit = StemEdit((5, 6), (30,), "filler", filler=0)  # 5 and 6 occur in IDS only together
    with torch.no_grad():
        before = model(IDS).logits
        per_call = model(IDS, stem_input_ids=edited_ids(IDS, [edit])).logits
        with StemEditor(model, [edit]):
            in_editor = model(IDS).logits
        with persisted(model, edit):
            in_tables = model(IDS).logits
        with swapped_rows(model, edit, "tables"):
            in_lab = model(IDS).logits
        by_hand = model(IDS, stem_input_ids=torch.where(IDS == 5, 30, torch.where(IDS == 6, 0, IDS))).logits
    assert not torch.allclose(per_call, before)
    for logits in (in_editor, in_tables, in_lab):
        torch.testing.assert_close(logits, per_call, rtol=0, atol=0)
    torch.testing.assert_close(by_hand, per_call, rtol=0, atol=0)


def test_the_cli_edits_with_the_filler_strategy(tmp_path, capsys):
    model = sensitive_model(vocab_size=259, max_position_embeddings=128)
    byte_tokenizer().save_pretrained(tmp_path / "m")
    model.save_pretrained(tmp_path / "m")
    main(["edit", str(tmp_path / "m"), "--source", "cat", "--target", "do", "--prompt", "the cat", "-n", "2",
          "--strategy", "filler"])  # fmt: skip
    assert "after (filler):" in capsys.readouterr().out


# Knowledge injection: a new fact trained into one token's rows


FACT = ["Q is a zebra.", "My Q is a zebra!", "A zebra, Q is."]


def _fact_model_and_token(table_dtype: str = "bfloat16"):
    model = sensitive_model(vocab_size=259, max_position_embeddings=128, std=0.3, table_dtype=table_dtype)
    tokenizer = byte_tokenizer()
    (token,) = tokenizer("Q", add_special_tokens=False).input_ids
    return model, tokenizer, token


def _fact_loss(model, tokenizer) -> float:
    ids = tokenizer(FACT[0], return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def test_an_injected_fact_changes_only_its_tokens_rows_and_lowers_its_loss():
    from stem_hf.injection import inject_fact

    model, tokenizer, token = _fact_model_and_token()
    model.train()
    model.model.embed_tokens.weight.requires_grad_(False)  # flags as the caller left them
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_before = _fact_loss(model, tokenizer)
    injection = inject_fact(model, tokenizer, FACT, token, steps=30, lr=3e-2)
    assert model.training and not model.model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    for name, weight in before.items():
        if "stem_tables" in name:
            others = torch.ones(weight.shape[0], dtype=torch.bool)
            others[token] = False
            assert torch.equal(after[name][others], weight[others]), name
            assert not torch.equal(after[name][token], weight[token]), name
        else:
            assert torch.equal(after[name], weight), name
    assert injection.losses[-1] < injection.losses[0]
    model.eval()
    assert _fact_loss(model, tokenizer) < loss_before


@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16"])
def test_an_injection_is_undone_exactly_and_persists_through_save(tmp_path, table_dtype):
    from stem_hf.injection import inject_fact, injected

    model, tokenizer, token = _fact_model_and_token(table_dtype)
    model.stem_save_id = "loaded-id"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with injected(model, tokenizer, FACT, token, steps=5) as injection:
        assert model.stem_save_id != "loaded-id" and len(injection.losses) == 6
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.stem_save_id == "loaded-id"
    injection = inject_fact(model, tokenizer, FACT, token, steps=5)
    rows = model.model.stem_tables["1"].weight[token].clone()
    model.save_pretrained(tmp_path / "injected")
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "injected")
    assert torch.equal(reloaded.model.stem_tables["1"].weight[token], rows)
    injection.undo()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="already undone"):
        injection.undo()


def test_bad_injections_are_clear_errors_before_any_work():
    from stem_hf.injection import inject_fact

    model, tokenizer, token = _fact_model_and_token()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"token 259 is not a token id in the vocabulary \[0, 259\)"):
        inject_fact(model, tokenizer, FACT, 259)
    with pytest.raises(ValueError, match="texts must be a non-empty list"):
        inject_fact(model, tokenizer, [], token)
    with pytest.raises(ValueError, match=r"the text 'no such letter' never contains token"):
        inject_fact(model, tokenizer, [*FACT, "no such letter"], token)
    with pytest.raises(ValueError, match="no STEM layers"):
        inject_fact(tiny_model(stem_layers=[]), tokenizer, FACT, token)
    with StemEditor(model, [StemEdit((5,), (6,))], require=False), pytest.raises(ValueError, match="row source"):
        inject_fact(model, tokenizer, FACT, token)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
