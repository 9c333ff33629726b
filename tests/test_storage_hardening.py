"""Checkpoint hardening (issue 23): index entries that leave the folder, corrupt indexes and headers, saves torn between
their renames, stale staging folders, provenance files tied to the weights they describe, and weight-file variants."""

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf import StemForCausalLM
from stem_hf.evaluation import RESULTS_FILE, evaluate
from stem_hf.model_card import render_model_card
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model
from tests.fake_hub import fake_hub, hub_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX = "model.safetensors.index.json"
DENSE = "model-00001-of-00001.safetensors"
TABLES = "stem-tables-00001-of-00001.safetensors"
REPORT = "conversion_report.json"


def _read_raw(path) -> tuple[dict, bytes]:
    data = open(path, "rb").read()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def _write_raw(path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def _index(folder) -> dict:
    return json.loads((folder / INDEX).read_text())


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


@pytest.fixture
def saved(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


# 1. Index entries outside the checkpoint folder


@pytest.mark.parametrize("entry", ["../other/" + TABLES, "sub/../../other/" + TABLES, "ABSOLUTE"])
def test_an_index_entry_outside_the_checkpoint_folder_is_refused(saved, tmp_path, entry):
    _, folder = saved
    tiny_model().save_pretrained(tmp_path / "other")  # a real file of the right shapes lies there
    (folder / "sub").mkdir()
    entry = str(tmp_path / "other" / TABLES) if entry == "ABSOLUTE" else entry
    index = _index(folder)
    index["weight_map"]["model.stem_tables.3.weight"] = entry
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{INDEX}: entry '{entry}' for model.stem_tables.3.weight points outside"):
        StemForCausalLM.from_pretrained(folder)


# 2. Corrupt indexes and safetensors headers


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "is not valid JSON"),
        ('{"metadata": {}}', 'has no "weight_map"'),
        ('{"weight_map": [1]}', 'is corrupt: its "weight_map" must map'),
    ],
)
def test_an_index_that_is_not_json_or_lacks_a_weight_map_names_the_file(saved, text, says):
    _, folder = saved
    (folder / INDEX).write_text(text)
    with pytest.raises(ValueError, match=f"{INDEX} {says}"):
        StemForCausalLM.from_pretrained(folder)


def _end_before_begin(entry: dict) -> None:
    entry["data_offsets"] = entry["data_offsets"][::-1]


def _overlapping(entry: dict) -> None:
    entry["data_offsets"] = [entry["data_offsets"][0] - 64, entry["data_offsets"][1] - 64]


def _wrong_dtype(entry: dict) -> None:
    entry["dtype"] = "F32"  # twice the bytes the offsets span


def _no_dtype(entry: dict) -> None:
    del entry["dtype"]


def _no_offsets(entry: dict) -> None:
    del entry["data_offsets"]


@pytest.mark.parametrize(
    ("corrupt", "says"),
    [
        (_end_before_begin, "ends before it begins"),
        (_overlapping, "overlaps tensor model.stem_tables.1.weight"),
        (_wrong_dtype, "spans 12288 bytes but a F32 tensor of shape \\[96, 64\\] takes 24576"),
        (_no_dtype, "has no dtype"),
        (_no_offsets, "has no data_offsets"),
    ],
)
def test_inconsistent_data_offsets_name_the_file_and_the_tensor(saved, corrupt, says):
    _, folder = saved
    header, body = _read_raw(folder / TABLES)
    assert header["model.stem_tables.3.weight"]["data_offsets"] == [12288, 24576]
    corrupt(header["model.stem_tables.3.weight"])
    _write_raw(folder / TABLES, header, body)
    with pytest.raises(ValueError, match=f"{TABLES} is corrupt: tensor model.stem_tables.3.weight {says}"):
        StemForCausalLM.from_pretrained(folder)


# 3. Saves torn between their renames, and the staging folders killed saves leave


def test_a_save_killed_between_any_two_renames_is_refused_at_load_never_loaded_as_a_mix(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    old = tiny_model()
    old.save_pretrained(folder)
    old_state, real_replace = _state(old), os.replace
    for kills_after in range(1, 8):  # 7 files replaced in turn, then the index
        new = tiny_model()  # other weights, same shapes
        done = []

        def replace(src, dst, *args, _after=kills_after, _done=done, **kwargs):
            if os.path.dirname(os.fspath(dst)) == str(folder) and not os.fspath(dst).endswith("README.md"):
                if len(_done) == _after:
                    raise KeyboardInterrupt("killed")
                _done.append(dst)
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            new.save_pretrained(folder)
        monkeypatch.undo()
        try:
            loaded = StemForCausalLM.from_pretrained(folder)
        except ValueError as err:
            assert "incomplete save" in str(err) and "re-run save_pretrained" in str(err), err
        else:
            assert _same(_state(loaded), old_state), f"killed after {kills_after} renames: a mix loaded"
        old.save_pretrained(folder)  # a whole save repairs the folder
        assert _same(_state(StemForCausalLM.from_pretrained(folder)), old_state)


@pytest.mark.parametrize(
    ("from_other_save", "named"),
    [((TABLES,), TABLES), ((TABLES, DENSE), DENSE), ((INDEX,), "config.json")],
)
def test_files_from_two_saves_are_refused_as_an_incomplete_save(saved, tmp_path, from_other_save, named):
    model, folder = saved
    with torch.no_grad():
        model.model.stem_tables["1"].weight.add_(1)
        model.model.embed_tokens.weight.add_(1)
    model.save_pretrained(tmp_path / "newer")
    for name in from_other_save:  # what a save killed between its renames leaves
        (folder / name).write_bytes((tmp_path / "newer" / name).read_bytes())
    with pytest.raises(ValueError, match=f"incomplete save: .*{named} belongs to another save.*re-run save_pretrained"):
        StemForCausalLM.from_pretrained(folder)


def test_checkpoints_saved_before_save_ids_load_and_one_stamped_file_among_them_is_refused(saved):
    model, folder = saved
    index = _index(folder)
    del index["metadata"]["stem_save_id"]
    (folder / INDEX).write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    del config["stem_save_id"]
    (folder / "config.json").write_text(json.dumps(config))
    stamped = {}
    for name in (DENSE, TABLES):
        header, body = _read_raw(folder / name)
        stamped[name] = (json.loads(json.dumps(header)), body)
        del header["__metadata__"]["stem_save_id"]
        _write_raw(folder / name, header, body)
    assert _same(_state(StemForCausalLM.from_pretrained(folder)), _state(model))
    _write_raw(folder / TABLES, *stamped[TABLES])
    with pytest.raises(ValueError, match=f"incomplete save: .*{TABLES} belongs to another save"):
        StemForCausalLM.from_pretrained(folder)


def _age(path, seconds: float = 3600) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_the_next_save_removes_staging_folders_of_killed_saves_and_nothing_else(saved, tmp_path):
    import fcntl

    model, folder = saved
    left_inside = folder / ".stem-saving-k1llm3xx"  # the name the save before this change gave its staging folder
    left_beside = tmp_path / ".stem-saving-new-0123456789ab"  # a killed save to a new folder `new`
    others = {
        "another target's": tmp_path / ".stem-saving-news-0123456789ab",
        "a file, not a folder": folder / ".stem-saving-notes.txt",
        "just created": folder / ".stem-saving-fresh0000000",
        "held by a live save": folder / ".stem-saving-live0000000",
    }
    for path in (left_inside, left_beside, *others.values()):
        if path.suffix == ".txt":
            path.write_text("mine")
        else:
            path.mkdir()
            (path / TABLES).write_bytes(b"half")
        if path != others["just created"]:
            _age(path)
    held = os.open(others["held by a live save"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        model.save_pretrained(folder)
        model.save_pretrained(tmp_path / "new")
    finally:
        os.close(held)
    assert not left_inside.exists() and not left_beside.exists()
    for what, path in others.items():
        assert path.exists(), what
    assert _same(_state(StemForCausalLM.from_pretrained(tmp_path / "new")), _state(model))


@pytest.mark.slow
def test_a_save_killed_by_sigkill_before_its_index_is_refused_until_the_next_save_cleans_up(saved, tmp_path):
    model, folder = saved
    code = f"""
        import os, signal, torch
        from tests.conftest import tiny_model
        torch.manual_seed(1)
        real = os.replace
        def replace(src, dst, *args, **kwargs):
            if os.fspath(dst) == {str(folder / INDEX)!r}:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *args, **kwargs)
        os.replace = replace
        tiny_model().save_pretrained({str(folder)!r})
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    (staging,) = [p for p in folder.iterdir() if p.name.startswith(".stem-saving-")]
    with pytest.raises(ValueError, match="incomplete save: .*belongs to another save"):
        StemForCausalLM.from_pretrained(folder)
    _age(staging)
    model.save_pretrained(folder)
    assert not staging.exists()
    assert _same(_state(StemForCausalLM.from_pretrained(folder)), _state(model))


# 4. Provenance files tied to the weights they describe


def test_convert_ties_its_report_to_the_weights_and_a_later_save_unties_it(tmp_path, caplog):
    from stem_hf.conversion import convert

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    dense = LlamaForCausalLM(LlamaConfig(**shape, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)).eval()
    out = tmp_path / "converted"
    _, report = convert(dense, out, stem_layers=[1], init="xavier")
    saved_report = json.loads((out / REPORT).read_text())
    assert saved_report["stem_save_id"] == report["stem_save_id"] == _index(out)["metadata"]["stem_save_id"]
    assert "tables initialized with `xavier`" in str(render_model_card(out))
    with caplog.at_level(logging.WARNING):
        tiny_model().save_pretrained(out)  # another model into the same folder
    assert REPORT in caplog.text and "earlier save" in caplog.text
    assert (out / REPORT).is_file()  # the user's file stays
    text = (out / "README.md").read_text()
    assert "not converted from a dense checkpoint" in text and "xavier" not in text


@pytest.mark.slow
def test_evaluation_results_are_tied_to_the_checkpoint_evaluated(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    tiny_model(vocab_size=BYTE_VOCAB, max_position_embeddings=128).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    model = StemForCausalLM.from_pretrained(folder)
    evaluate(model, ["stem_facts"], byte_tokenizer(), limit=2, output=folder / RESULTS_FILE)
    results = json.loads((folder / RESULTS_FILE).read_text())
    assert results["stem_save_id"] == _index(folder)["metadata"]["stem_save_id"]
    assert "| stem_facts | acc |" in str(render_model_card(folder))
    with caplog.at_level(logging.WARNING):
        tiny_model(vocab_size=BYTE_VOCAB).save_pretrained(folder)
    assert RESULTS_FILE in caplog.text
    assert "| stem_facts | acc |" not in (folder / "README.md").read_text()

    # Results of other weights are not merged with new ones: the file would claim them for this checkpoint.
    reloaded = StemForCausalLM.from_pretrained(folder)
    evaluate(reloaded, ["stem_facts"], byte_tokenizer(), limit=1, output=folder / RESULTS_FILE)
    results = json.loads((folder / RESULTS_FILE).read_text())
    assert results["stem_save_id"] == _index(folder)["metadata"]["stem_save_id"]
    assert results["n-samples"]["stem_facts"]["effective"] == 1
    aside = [p for p in folder.iterdir() if p.name.startswith("lm_eval_results.") and p.name != RESULTS_FILE]
    assert len(aside) == 1 and json.loads(aside[0].read_text())["n-samples"]["stem_facts"]["effective"] == 2  # kept


def _pushed(code: str, tmp_path) -> dict[str, bytes]:
    """Runs `code` (which pushes to "user/pushed") in a fresh interpreter against a loopback Hub; the repo's files."""
    with fake_hub(lifetime=300) as (endpoint, state):
        env = hub_env(endpoint)
        env = {**os.environ, **env, "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": ROOT}
        run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        return state.repos["user/pushed"]


@pytest.mark.slow
def test_push_to_hub_uploads_only_provenance_of_the_weights_it_pushes(tmp_path):
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder)
    save_id = _index(folder)["metadata"]["stem_save_id"]
    report = {"source": "org/dense", "init": "xavier", "stem_save_id": save_id}
    (folder / REPORT).write_text(json.dumps(report))
    (folder / RESULTS_FILE).write_text(json.dumps({"results": {}, "stem_save_id": "0" * 32}))  # another save's
    code = f"""
        from stem_hf import StemForCausalLM
        StemForCausalLM.from_pretrained({str(folder)!r}).push_to_hub("user/pushed")
    """
    files = _pushed(code, tmp_path)
    assert RESULTS_FILE not in files
    pushed_id = json.loads(files[INDEX])["metadata"]["stem_save_id"]
    assert json.loads(files[REPORT])["stem_save_id"] == pushed_id != save_id  # the pushed weights are the loaded ones
    assert "tables initialized with `xavier`" in files["README.md"].decode()


# 5. Weight-file variants


def test_a_variant_saves_beside_the_default_weights_and_loads_with_the_same_outputs(saved):
    model, folder = saved
    other = tiny_model()
    other.save_pretrained(folder, variant="fp16")
    files = {p.name for p in folder.iterdir()}
    assert {"model.safetensors.index.fp16.json", "model.fp16-00001-of-00001.safetensors"} <= files
    assert "stem-tables.fp16-00001-of-00001.safetensors" in files
    assert {INDEX, DENSE, TABLES} <= files  # the default weights stay
    input_ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        for variant, expected in ((None, model), ("fp16", other)):
            loaded = StemForCausalLM.from_pretrained(folder, variant=variant).eval()
            assert torch.equal(loaded(input_ids).logits, expected(input_ids).logits), variant
    (folder / "stem-tables.fp16-00001-of-00001.safetensors").unlink()  # the checks read the variant's index too
    with pytest.raises(FileNotFoundError, match=r"stem-tables.fp16-00001-of-00001.safetensors is missing"):
        StemForCausalLM.from_pretrained(folder, variant="fp16")
    assert _same(_state(StemForCausalLM.from_pretrained(folder)), _state(model))


def test_a_save_killed_after_its_config_under_an_index_it_shares_no_file_with_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder)  # one dense shard, one table shard
    new = tiny_model(rope_parameters={"rope_type": "default", "rope_theta": 500.0})  # same shapes, another config
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.fspath(dst) == str(folder / "model.safetensors.index.json"):
            raise KeyboardInterrupt("killed before the index")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(folder, max_shard_size="8KB")  # every weight file named apart from the old ones
    monkeypatch.undo()
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_theta"] == 500.0
    with pytest.raises(ValueError, match=r"incomplete save: .*config.json belongs to another save"):
        StemForCausalLM.from_pretrained(folder)


@pytest.mark.slow
def test_stem_hf_push_and_analyze_leave_out_provenance_of_weights_saved_over(tmp_path):
    from stem_hf.cli import _converted_from

    folder = tmp_path / "ckpt"
    tiny_model(vocab_size=BYTE_VOCAB).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    dense = tmp_path / "dense"
    dense.mkdir()
    report = {"source": str(dense), "init": "xavier", "stem_save_id": _index(folder)["metadata"]["stem_save_id"]}
    (folder / REPORT).write_text(json.dumps(report))
    assert _converted_from(str(folder)) == str(dense)
    tiny_model(vocab_size=BYTE_VOCAB).save_pretrained(folder)  # other weights: the report no longer describes them
    assert _converted_from(str(folder)) is None
    code = f"""
        from stem_hf.hub import push_checkpoint
        push_checkpoint({str(folder)!r}, "user/pushed")
    """
    files = _pushed(code, tmp_path)
    assert INDEX in files and REPORT not in files
    assert (folder / REPORT).is_file()  # kept in the folder


def test_results_of_other_weights_are_set_aside_under_distinct_names_and_not_pushed(tmp_path):
    from stem_hf.evaluation import _merge_into

    path = tmp_path / RESULTS_FILE
    for save_id in ("a" * 32, "b" * 32, "unsaved-c", "../../evil"):  # all within one second
        _merge_into(path, {"results": {"t": {"acc": 1.0}}}, save_id)
    aside = sorted(p.name for p in tmp_path.iterdir() if p.name != RESULTS_FILE)
    assert len(aside) == 3 and all(name.startswith("lm_eval_results.") for name in aside)
    assert json.loads(path.read_text())["stem_save_id"] == "../../evil"
    _merge_into(path, {"results": {}}, "d" * 32)  # an id that is not a file name stays out of paths
    assert len([p for p in tmp_path.iterdir() if p.parent == tmp_path]) == 5


# 5. Loads and saves into one folder at the same time (issue 35)


def _replace_all(source, folder) -> None:
    """What a save's commit does: each checkpoint file of `source` renamed into `folder`, the index last."""
    names = sorted((p.name for p in source.iterdir() if p.is_file()), key=lambda name: name == INDEX)
    for name in names:
        os.replace(source / name, folder / name)


def test_a_load_that_meets_a_commit_waits_for_it_and_reads_only_the_new_save(saved, tmp_path):
    from stem_hf.checkpoint_stem import commit_lock

    model, folder = saved
    torch.manual_seed(1)
    other = tiny_model()
    other.save_pretrained(tmp_path / "other")
    loaded = {}

    def load():
        loaded["model"] = StemForCausalLM.from_pretrained(folder)

    with commit_lock(str(folder)):  # the lock a save holds while it renames its files in
        reader = threading.Thread(target=load)
        reader.start()
        reader.join(timeout=2.0)
        assert reader.is_alive(), "the load did not wait for the commit in progress"
        _replace_all(tmp_path / "other", folder)
    reader.join()
    assert _same(_state(loaded["model"]), _state(other))


def test_a_save_commits_only_after_loads_in_progress(saved):
    from stem_hf.checkpoint_stem import reading_checkpoint

    model, folder = saved
    before = {p.name: p.stat().st_ino for p in folder.iterdir() if p.suffix == ".safetensors"}
    torch.manual_seed(1)
    other = tiny_model()
    with reading_checkpoint(folder):  # a load in progress
        writer = threading.Thread(target=other.save_pretrained, args=(folder,))
        writer.start()
        writer.join(timeout=2.0)
        assert writer.is_alive(), "the save renamed files under a load in progress"
        assert {p.name: p.stat().st_ino for p in folder.iterdir() if p.suffix == ".safetensors"} == before
    writer.join()
    assert _same(_state(StemForCausalLM.from_pretrained(folder)), _state(other))


@pytest.mark.parametrize("replaced", [TABLES, DENSE, INDEX, "config.json"])
def test_a_file_replaced_without_the_lock_during_a_read_fails_it(saved, tmp_path, replaced):
    from stem_hf.checkpoint_stem import reading_checkpoint

    model, folder = saved
    tiny_model().save_pretrained(tmp_path / "other")
    with pytest.raises(RuntimeError, match=f"{replaced} changed while the checkpoint was read.*run it again"):
        with reading_checkpoint(folder):
            os.replace(tmp_path / "other" / replaced, folder / replaced)  # a writer that does not take the lock


@pytest.mark.slow
def test_loads_during_alternating_saves_each_read_one_save_whole(tmp_path):
    """Real processes: one saves two checkpoints of the same shape into one folder in turn, this one loads it
    meanwhile; every load equals one of them exactly and none is refused."""
    models = {}
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        models[name] = tiny_model()
        models[name].save_pretrained(tmp_path / name, max_shard_size="20KB")  # several shards: a longer commit
    folder, saves = tmp_path / "ckpt", 120
    models["a"].save_pretrained(folder, max_shard_size="20KB")
    code = f"""
        from stem_hf import StemForCausalLM
        a = StemForCausalLM.from_pretrained({str(tmp_path / "a")!r})
        b = StemForCausalLM.from_pretrained({str(tmp_path / "b")!r})
        for i in range({saves}):
            (b if i % 2 == 0 else a).save_pretrained({str(folder)!r}, max_shard_size="20KB")
    """
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "PYTHONPATH": ROOT}, stderr=subprocess.PIPE
    )
    states = {name: _state(model) for name, model in models.items()}
    seen = {"a": 0, "b": 0}
    try:
        while writer.poll() is None:
            state = _state(StemForCausalLM.from_pretrained(folder))
            match = [name for name, expected in states.items() if _same(state, expected)]
            assert match, "a load mixed the files of two saves"
            seen[match[0]] += 1
    finally:
        writer.kill()
        _, stderr = writer.communicate()
    assert writer.returncode == 0, stderr.decode()[-3000:]
    print(seen)
    assert seen["a"] and seen["b"] and sum(seen.values()) >= 30, seen


# 6. Configs and shards that would load as a silently wrong model (issue 35)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
def test_a_table_shard_rewritten_as_integers_is_refused(saved, dtype):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, folder = saved
    with safe_open(folder / TABLES, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k).to(dtype) for k in f.keys()}
    save_file(tensors, folder / TABLES, metadata=metadata)  # the save id kept: only the dtype is wrong
    with pytest.raises(
        ValueError, match=rf"{TABLES}: tensor model.stem_tables.1.weight is stored as (I64|U8); a table"
    ):
        StemForCausalLM.from_pretrained(folder)


def test_a_dense_shard_rewritten_as_integers_is_refused(saved):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, folder = saved
    with safe_open(folder / DENSE, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, folder / DENSE, metadata=metadata)
    with pytest.raises(ValueError, match="model.norm.weight is stored as I32, not as floating point"):
        StemForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("layers", [3, 5])
def test_a_config_with_another_layer_count_than_the_files_is_refused(tmp_path, layers):
    folder = tmp_path / "ckpt"
    tiny_model(stem_layers=[1]).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"num_hidden_layers={layers} but the weight files hold layers 0..3 \(4 of"):
        StemForCausalLM.from_pretrained(folder)


def test_a_missing_index_beside_its_shards_is_named(tmp_path):
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder)
    (folder / INDEX).unlink()
    with pytest.raises(FileNotFoundError, match=f"{INDEX} is missing: .* holds weight shards \\(model-00001-of-00001"):
        StemForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("rms_norm_eps", float("nan"), "rms_norm_eps: nan must be a positive finite number"),
        ("num_key_value_heads", 0, "num_key_value_heads: 0 must be a positive integer"),
        ("head_dim", -8, "head_dim: -8 must be a positive integer"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": float("inf")}, r"rope_theta'\]: inf must be"),
    ],
)
def test_a_config_json_with_a_bad_number_is_refused_before_any_weight_is_read(saved, field, value, says):
    model, folder = saved
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))  # json writes NaN and Infinity, as a hand edit could
    with pytest.raises(ValueError, match=says):
        StemForCausalLM.from_pretrained(folder)


def test_saving_through_a_dangling_symlink_names_the_link(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="link is a symbolic link to .*gone, which does not exist"):
        tiny_model().save_pretrained(link)
    assert not (tmp_path / "gone").exists() and link.is_symlink()


def test_a_load_of_a_variant_the_folder_lacks_names_the_variants_it_holds(tmp_path):
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder, variant="fp16")
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors.index.json: it holds the weights of "
                       r"variant='fp16'; load one of them"):  # fmt: skip
        StemForCausalLM.from_pretrained(folder)
    (folder / "model.safetensors.index.fp16.json").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.fp16.json is missing: .* holds weight shards"):
        StemForCausalLM.from_pretrained(folder, variant="fp16")
