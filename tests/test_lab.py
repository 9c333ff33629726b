"""The knowledge lab at its quick size: a STEM model trained here learns its facts; where the identity of an entity is
only in the tables, a row swap moves the answers and leaves other answers alone; baselines and strategies run through
the same code; the world, its tokenizer and the fact table behave."""

import dataclasses

import pytest
import torch

from stem_hf.edit_eval import divergence_closed, named
from stem_hf.editing import STRATEGIES, StemEdit
from stem_hf.lab.corpus import COUNTRY_TEMPLATES, PERSON_TEMPLATES, LabWorld, build_tokenizer, documents, make_world
from stem_hf.lab.measure import edit_pairs, evaluate_edits, known_people, localization, recall, swapped_rows
from stem_hf.lab.train import (
    QUICK,
    Blocks,
    EntityDropoutCollator,
    check_regime,
    entity_ids,
    lab_configs,
    train_lab_model,
)

# General text for the tests: seeded, written here (the benchmark uses the bundled registry corpus).
WORDS = "the a of and to in is was it that he she they we you on with for as at by this from but not or".split()
GENERAL = [" ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(400)) for i in range(20)]


def train(tmp_path, regime: str, **world_args):
    world = make_world(QUICK.people, seed=0, **world_args)
    tokenizer = build_tokenizer(world, GENERAL, QUICK.general_words)
    data = Blocks(world, tokenizer, GENERAL, QUICK)
    config = lab_configs(QUICK, len(tokenizer))["STEM-full"]
    model, info = train_lab_model(config, regime, data, world, tokenizer, QUICK, tmp_path)
    return model, world, tokenizer, info


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return train(tmp_path_factory.mktemp("plain"), "plain")


@pytest.fixture(scope="module")
def in_tables(tmp_path_factory):
    """Identity only in the tables: every name is one token, and the names' embedding rows are one frozen row."""
    return train(tmp_path_factory.mktemp("shared"), "shared-embedding", name_lengths=(1,))


@pytest.mark.slow
def test_a_lab_model_recalls_its_trained_facts(plain):
    model, world, tokenizer, info = plain
    result = recall(model, world, tokenizer)
    assert result["person_train"]["recall"] >= 0.9
    assert result["country_train"]["recall"] >= 0.9
    assert set(result["person_train"]["by_name_tokens"]) == {"1", "2", "3"}
    assert 0 < result["stored_bits"] <= result["max_bits"]
    assert info["train_loss"][-1][1] < info["train_loss"][0][1]


@pytest.mark.slow
def test_a_row_swap_moves_facts_that_live_in_the_rows(in_tables):
    model, world, tokenizer, _ = in_tables
    known = known_people(recall(model, world, tokenizer), threshold=1.0)  # every fact of A and of B recalled
    assert len(known) >= 8
    pairs = edit_pairs(world, tokenizer, known, 40, seed=0, same_length=True)
    result = evaluate_edits(model, world, tokenizer, pairs, strategies=("pad",))["methods"]
    assert result["tables/pad"]["efficacy"] >= 0.9
    assert result["tables/pad"]["locality"] >= 0.95
    # Here the edited input is exactly B's (same embedding row, B's table rows): the divergence closes entirely.
    assert (
        result["tables/pad"]["divergence_closed"] >= 0.99 and abs(result["embedding/pad"]["divergence_closed"]) <= 0.01
    )
    # The same code measures the baselines: the names' embedding rows are one row, so swapping them does nothing.
    assert result["embedding/pad"]["efficacy"] <= 0.05
    assert result["embedding/pad"]["locality"] == 1.0
    assert result["text"]["efficacy"] >= 0.9 and result["text"]["locality"] is None
    # Knocking the names' table rows out takes the facts with them; knocking their embedding rows out does not.
    where = localization(model, world, tokenizer, known)
    assert where["tables"] <= 0.3 < 0.9 <= where["embedding"]


def test_unequal_name_lengths_run_under_each_strategy(plain):
    model, world, tokenizer, _ = plain
    lengths = [len(p["name"].split()) for p in world.people]
    a, b = lengths.index(1), lengths.index(3)
    result = evaluate_edits(model, world, tokenizer, [(a, b), (b, a)], locality_people=4)
    keys = {f"{m}/{s}" for m in ("tables", "embedding", "both") for s in STRATEGIES} | {"text"}
    assert set(result["methods"]) == keys
    for key, measures in result["methods"].items():
        assert 0.0 <= measures["efficacy"] <= 1.0, key
        assert measures["prompts"]["efficacy"] > 0
    # A persisted edit of a name rewrites rows its words share with other names: locality fails there.
    assert result["methods"]["both/clone"]["prompts"]["shared_name_token"] > 0
    assert result["methods"]["both/clone"]["locality_shared_name_token"] < 1.0


def test_the_edits_leave_the_model_as_it_was(plain):
    model, world, tokenizer, _ = plain
    model.stem_save_id = "saved-id"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    embedding = model.get_input_embeddings()
    evaluate_edits(model, world, tokenizer, [(0, 2)], locality_people=2)
    localization(model, world, tokenizer, [0, 1])
    assert model.get_input_embeddings() is embedding
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.stem_save_id == "saved-id"  # the rows are the saved ones again
    with pytest.raises(ValueError, match="where must be"):
        with swapped_rows(model, StemEdit((5,), (6,)), "table"):
            pass
    with pytest.raises(ValueError, match="kind must be"):
        evaluate_edits(model, world, tokenizer, [(0, 2)], kind="people")


def test_the_fact_table_round_trips(tmp_path):
    world = make_world(30, seed=3)
    world.save(tmp_path)
    assert LabWorld.load(tmp_path) == world
    assert make_world(30, seed=3) == world and make_world(30, seed=4) != world
    tokenizer = build_tokenizer(world, GENERAL, 50)
    for person in world.people:  # every name word and value is one token, never the unknown one
        ids = tokenizer(person["name"], add_special_tokens=False)["input_ids"]
        assert len(ids) == len(person["name"].split()) and tokenizer.unk_token_id not in ids
    assert {len(p["name"].split()) for p in world.people} == {1, 2, 3}
    with pytest.raises(FileNotFoundError, match="facts.json"):
        LabWorld.load(tmp_path / "nowhere")


def test_no_prompt_is_the_start_of_another_template():
    """A prompt that begins another template ("X was born in" before "X was born in the year 1950") has two answers."""
    for templates in (PERSON_TEMPLATES, COUNTRY_TEMPLATES):
        texts = [t for trained, heldout in templates.values() for t in trained + heldout]
        for text in texts:
            prompt = text.split("{v}")[0]
            assert [other for other in texts if other.startswith(prompt)] == [text], prompt


def test_entity_dropout_hides_only_entity_inputs():
    world = make_world(8, seed=0)
    tokenizer = build_tokenizer(world, GENERAL, 50)
    entities = entity_ids(world, tokenizer)
    settings = dataclasses.replace(QUICK, steps=4, batch_size=4, context=32)
    blocks = Blocks(world, tokenizer, GENERAL, settings)
    batch = EntityDropoutCollator(entities, tokenizer.mask_token_id, 1.0, seed=0)([blocks[i] for i in range(4)])
    hidden = batch["input_ids"] != batch["stem_input_ids"]
    assert torch.equal(hidden, torch.isin(batch["stem_input_ids"], entities)) and hidden.any()
    assert torch.equal(batch["labels"], batch["stem_input_ids"])
    assert "stem_input_ids" not in EntityDropoutCollator(entities, 4, 0.0, seed=0)([blocks[0]])


def test_bad_lab_settings_are_named():
    with pytest.raises(ValueError, match="unknown regime"):
        check_regime("dropout", stem=True)
    with pytest.raises(ValueError, match="dense model"):
        check_regime("entity-dropout-0.5", stem=False)
    assert check_regime("entity-dropout-0.25", stem=True) == 0.25
    with pytest.raises(ValueError, match="at least 2 people"):
        make_world(1)
    with pytest.raises(ValueError, match="general text with words"):
        documents(make_world(4), [" "], 100, 0.5, seed=0)
    with pytest.raises(ValueError, match="name_lengths"):
        make_world(10, name_lengths=(4,))


def test_the_lab_command_refuses_bad_input_before_training(tmp_path, capsys):
    from stem_hf.cli import main

    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match="already holds results.json"):
        main(["lab", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").read_text() == "{}"  # nothing lost
    with pytest.raises(SystemExit, match="unknown regime 'dropout'"):
        main(["lab", "--out", str(tmp_path / "new"), "--regimes", "dropout"])
    for option, value, minimum in (("--steps", "0", 1), ("--capacity", "1", 2)):
        with pytest.raises(SystemExit) as exit_info:  # refused as the command line is parsed
            main(["lab", "--out", str(tmp_path / "new"), option, value])
        assert exit_info.value.code == 2
        assert f"{option}: must be a whole number of at least {minimum}, not '{value}'" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_edit_answers_are_named_by_whole_words_and_divergence_is_a_share():
    capitals = ["Paris", "Athens", "Rome"]
    assert named("the city of Athens.", capitals) == "Athens"
    assert named("Rome, not Paris", capitals) == "Rome"
    assert named("Parisian food", capitals) is None
    source, target = torch.tensor([0.7, 0.2, 0.1]).log(), torch.tensor([0.1, 0.2, 0.7]).log()
    assert divergence_closed(target, source, target) == pytest.approx(1.0)
    assert divergence_closed(source, source, target) == pytest.approx(0.0)
    halfway = torch.tensor([0.4, 0.2, 0.4]).log()
    assert 0.0 < divergence_closed(halfway, source, target) < 1.0
