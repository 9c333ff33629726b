"""Past one host's memory: conversions that stream their tables to disk (the same checkpoint as in memory, byte for
byte), table files written in place, and the mapped token-major offload store (its rows, its engine, its refusals)."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stem_hf import StemForCausalLM
from stem_hf.checkpoint_stem import StemSafetensorsWriter, read_safetensors_header
from stem_hf.cli import main
from stem_hf.conversion import convert
from stem_hf.conversion import init_tables as init_tables_module
from stem_hf.conversion.plan import ConversionPlan
from stem_hf.conversion.save import StemTableStream
from stem_hf.mapped import map_safetensors
from stem_hf.offload import STORE_NAME, StemHostTables, StemMappedTables, StemOffloadEngine, write_offload_store
from tests.conftest import _cli_source, sensitive_model

CALIBRATION = [" ".join(f"w{i}" for i in range(5, 60))] * 3
HELDOUT = [" ".join(f"w{i}" for i in range(60, 3, -1))]
RECIPES = {
    "projected": dict(init="projected", refit="none"),  # shares the dense model's tensors
    "fitted": dict(init="fitted", prior_context=" w5"),  # statistics, prior context, refit "all", local training
    "mean": dict(init="mean", refit="sequential"),
    "xavier": dict(init="xavier"),
}


def _convert(source: Path, out: Path, stream: bool, **recipe):
    torch.manual_seed(0)  # xavier draws its rows
    kwargs = dict(stem_layers="1/2", calibration=CALIBRATION, heldout=HELDOUT, max_shard_size=9000)
    return convert(str(source), out, stream=stream, **kwargs, **recipe)


def _normalized(path: Path, report: dict, folder: Path) -> bytes:
    """A file's bytes with what differs between two saves of the same weights blanked: the save id each save draws,
    the folder the model card names, the wall time the report records."""
    data = path.read_bytes()
    if path.name == "conversion_report.json":
        data = json.dumps({k: v for k, v in json.loads(data).items() if k != "wall_time_s"}).encode()
    data = data.replace(report["stem_save_id"].encode(), b"SAVE-ID")
    return data.replace(str(folder).encode(), b"FOLDER")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_streamed_conversion_writes_the_in_memory_checkpoint_byte_for_byte(recipe, tmp_path):
    _cli_source(tmp_path)
    memory, streamed = tmp_path / "memory" / "out", tmp_path / "streamed" / "out"
    _, memory_report = _convert(tmp_path / "src", memory, False, **RECIPES[recipe])
    model, streamed_report = _convert(tmp_path / "src", streamed, True, **RECIPES[recipe])
    files = sorted(os.listdir(memory))
    assert files == sorted(os.listdir(streamed))
    assert len([f for f in files if f.startswith("stem-tables-")]) == 2  # max_shard_size split the tables
    for name in files:
        assert _normalized(memory / name, memory_report, memory) == _normalized(
            streamed / name, streamed_report, streamed
        ), name
    # The tables the returned model holds are copy-on-write maps of the files it wrote.
    table = model.model.stem_tables["1"].weight
    on_disk = (streamed / "stem-tables-00001-of-00002.safetensors").read_bytes()
    with torch.no_grad():
        table[0] += 1
    assert (streamed / "stem-tables-00001-of-00002.safetensors").read_bytes() == on_disk
    assert not [p for p in tmp_path.rglob(".stem-saving-*")]


def test_a_streamed_conversion_never_holds_a_table(tmp_path, monkeypatch):
    """Tables on the meta device until mapped, and every write a block of `ROW_BLOCK` rows or fewer, on a vocabulary
    of several blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    LlamaForCausalLM(LlamaConfig(vocab_size=3 * 512 + 7, **shape)).save_pretrained(tmp_path / "src")
    monkeypatch.setattr(init_tables_module, "ROW_BLOCK", 512)
    seen = []
    original = StemTableStream.write

    def write(self, layer, first_row, rows):
        seen.append((layer, first_row, len(rows), self.stem.model.stem_tables[str(layer)].weight.device.type))
        original(self, layer, first_row, rows)

    monkeypatch.setattr(StemTableStream, "write", write)
    convert(str(tmp_path / "src"), tmp_path / "out", stem_layers="full", init="projected", refit="none")
    assert [(first, n) for layer, first, n, _ in seen if layer == 1] == [(0, 512), (512, 512), (1024, 512), (1536, 7)]
    assert {device for *_, device in seen} == {"meta"}


@pytest.mark.parametrize("recipe", ["fitted", "mean"])
def test_calibration_in_layer_groups_writes_the_same_checkpoint(recipe, tmp_path, monkeypatch):
    """Where the statistics of every layer at once do not fit half the memory available, they are gathered a group of
    layers at a time, one pass over the text each: the tables come out the same, byte for byte."""
    convert_module = sys.modules["stem_hf.conversion.convert"]  # the package exports the function of that name
    _cli_source(tmp_path)
    recipe = {**RECIPES[recipe], "stem_layers": "full", "prior_context": " w5 w6"}
    kwargs = dict(calibration=CALIBRATION, heldout=HELDOUT, max_shard_size=9000, **recipe)
    torch.manual_seed(0)
    whole, grouped = tmp_path / "whole" / "out", tmp_path / "grouped" / "out"  # the card names the folder
    _, whole_report = convert(str(tmp_path / "src"), whole, **kwargs)
    passes, calibrate = [], init_tables_module.calibrate

    def counted(dense, chunks, layers, *args):
        passes.append(list(layers))
        return calibrate(dense, chunks, layers, *args)

    monkeypatch.setattr(init_tables_module, "calibrate", counted)
    monkeypatch.setattr(convert_module, "available_memory", lambda: 1000)  # less than one layer's statistics
    torch.manual_seed(0)
    _, grouped_report = convert(str(tmp_path / "src"), grouped, **kwargs)
    assert passes == [[1], [2], [3]]  # "full": every layer but the first
    assert sorted(os.listdir(whole)) == sorted(os.listdir(grouped))
    for name in os.listdir(whole):
        assert _normalized(whole / name, whole_report, whole) == _normalized(grouped / name, grouped_report, grouped)


def test_layer_groups_fit_the_budget():
    from stem_hf.conversion.init_tables import layer_groups

    assert layer_groups([1, 2, 3], 10, None) == [[1, 2, 3]]
    assert layer_groups([1, 2, 3], 10, 25) == [[1, 2], [3]]
    assert layer_groups([1, 2, 3], 10, 5) == [[1], [2], [3]]  # one layer a group at worst
    assert layer_groups([1, 2, 3], 10, 10**9) == [[1, 2, 3]]


def test_a_failed_streamed_conversion_leaves_the_old_checkpoint_and_no_staging(tmp_path, monkeypatch):
    _cli_source(tmp_path)
    out = tmp_path / "out"
    _convert(tmp_path / "src", out, True, **RECIPES["projected"])
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    calls = []

    def fail(*args):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("killed halfway through the tables")
        return original(*args)

    original = init_tables_module.projected_rows
    monkeypatch.setattr(init_tables_module, "projected_rows", fail)
    with pytest.raises(RuntimeError, match="halfway"):
        _convert(tmp_path / "src", out, True, **RECIPES["projected"])
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert not [p for p in tmp_path.rglob(".stem-saving-*")]


def test_streaming_refuses_healing_and_in_memory_tables_larger_than_memory(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="healing trains the tables"):
        ConversionPlan(init="projected", stream=True, heal_tokens=10)
    assert ConversionPlan(init="projected", heal_tokens=10).stream is False
    assert ConversionPlan(init="projected").stream is True
    _cli_source(tmp_path)
    convert_module = sys.modules["stem_hf.conversion.convert"]  # the package exports the function of that name
    monkeypatch.setattr(convert_module, "available_memory", lambda: 1000)
    with pytest.raises(MemoryError, match="streams them to disk"):  # refused before the source loads
        convert(str(tmp_path / "src"), None, stem_layers="1/2", init="projected", refit="none")
    convert(str(tmp_path / "src"), tmp_path / "out", stem_layers="1/2", init="projected", refit="none")


def test_the_writer_writes_what_safetensors_writes(tmp_path):
    tensors = {f"model.stem_tables.{i}.weight": torch.randn(37, 12).to(torch.bfloat16) for i in (0, 2, 10, 11)}
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    with StemSafetensorsWriter(str(tmp_path / "ours.safetensors"), shapes, torch.bfloat16, {"format": "pt"}) as w:
        for name, tensor in reversed(tensors.items()):  # any order, any blocks
            w.write(name, 20, tensor[20:])
            w.write(name, 0, tensor[:20])
        with pytest.raises(ValueError, match="do not fit"):
            w.write("model.stem_tables.0.weight", 30, tensors["model.stem_tables.0.weight"][:10])
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    mapped = map_safetensors(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(mapped[name], tensor) for name, tensor in tensors.items())


def test_a_save_writes_tables_a_block_at_a_time(tmp_path, monkeypatch):
    from stem_hf import checkpoint_stem

    model = sensitive_model(table_dtype="bfloat16")
    model.save_pretrained(tmp_path / "whole")
    monkeypatch.setattr(checkpoint_stem, "WRITE_BLOCK_BYTES", 1000)  # 7 rows of 64 bf16 values per block
    blocks = []
    original = StemSafetensorsWriter.write
    monkeypatch.setattr(
        StemSafetensorsWriter, "write", lambda self, n, f, rows: blocks.append(len(rows)) or original(self, n, f, rows)
    )
    model.save_pretrained(tmp_path / "blocks")
    assert max(blocks) == 7 and sum(blocks) == 2 * 96
    for name in ("stem-tables-00001-of-00001.safetensors",):
        whole, blocked = (tmp_path / "whole" / name).read_bytes(), (tmp_path / "blocks" / name).read_bytes()
        (size,) = struct.unpack("<Q", whole[:8])
        assert whole[8 + size :] == blocked[8 + size :]
        assert read_safetensors_header(str(tmp_path / "whole" / name)) == read_safetensors_header(
            str(tmp_path / "blocks" / name)
        )


@pytest.fixture
def saved(tmp_path):
    model = sensitive_model(table_dtype="bfloat16")
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", StemForCausalLM.from_pretrained(tmp_path / "ckpt").eval()


def test_the_mapped_store_gathers_the_tables_rows_from_a_file(saved):
    folder, model = saved
    path = write_offload_store(folder)
    assert path == str(folder / STORE_NAME) and not os.path.exists(path + ".partial")
    store = StemMappedTables(path, model.config, model.stem_save_id)
    tables = {int(k): m.weight for k, m in model.model.stem_tables.items()}
    assert store.data.shape == (96, 2, 64) and store.layers == [1, 3]
    ids = torch.tensor([5, 6, 7, 0, 95, 5])
    rows, scales = store.gather(ids)
    assert scales is None
    for layer, slot in store.slot.items():
        assert torch.equal(rows[:, slot], tables[layer][ids])
    assert torch.equal(store.data, StemHostTables(tables).data)


def test_read_hints_cover_each_run_of_consecutive_ids_once(saved, monkeypatch):
    folder, model = saved
    store = StemMappedTables(write_offload_store(folder))
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, a: calls.append((o, n)) or real(fd, o, n, a))
    store.advise(torch.tensor([9, 3, 4, 5, 9, 20, 21, 95]))
    row = store.row_bytes()
    assert row == 2 * 64 * 2
    assert [((o - store.offset) // row, n // row) for o, n in calls] == [(3, 3), (9, 1), (20, 2), (95, 1)]
    end = store.offset + 96 * row
    assert end == os.path.getsize(folder / STORE_NAME)


@pytest.mark.parametrize("cache_tokens", [0, 6])
def test_the_engine_on_a_mapped_store_gives_identical_generations(saved, cache_tokens):
    folder, model = saved
    write_offload_store(folder)
    prompt = torch.tensor([[1, 5, 9, 33, 70, 5, 2]])
    with torch.no_grad():
        expected_logits = model(prompt).logits
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
        with StemOffloadEngine(model, cache_tokens=cache_tokens, store=folder / STORE_NAME) as engine:
            assert engine.stats["mapped"] and engine.stats["host_bytes"] == 96 * 2 * 64 * 2
            assert torch.equal(model(prompt).logits, expected_logits)
            assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), expected)


def test_a_truncated_mismatched_or_stale_store_is_refused(saved, tmp_path):
    folder, model = saved
    path = Path(write_offload_store(folder))
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    with pytest.raises(ValueError, match="truncated"):
        StemOffloadEngine(model, store=path)
    path.write_bytes(good)
    other = sensitive_model(table_dtype="bfloat16", stem_layers=[1, 2])
    with pytest.raises(ValueError, match=r"stem_layers \[1, 3\] but the model's config says \[1, 2\]"):
        StemOffloadEngine(other, store=path)
    with pytest.raises(ValueError, match="table_dtype bfloat16 but the model's config says float32"):
        StemOffloadEngine(sensitive_model(table_dtype="float32"), store=path)
    with pytest.raises(ValueError, match="int8, dtype and free_tables"):
        StemOffloadEngine(model, store=path, int8=True)
    model.save_pretrained(folder)  # a new save: the store no longer describes the checkpoint's weights
    reloaded = StemForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="the tables changed since"):
        StemOffloadEngine(reloaded, store=path)
    with pytest.raises(FileNotFoundError, match="no offload store"):
        StemOffloadEngine(model, store=tmp_path / "missing.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, foreign)
    with pytest.raises(ValueError, match="not a STEM offload store"):
        write_offload_store(folder, foreign)  # and it is left as it was
    assert "x" in read_safetensors_header(str(foreign))
    for where, says in (("", "is empty"), (folder, "is a folder")):  # not ./.partial, nor a folder's name
        with pytest.raises(ValueError, match=f"path: .* {says}; give the store's file path"):
            write_offload_store(folder, where)
    assert not Path(".partial").exists() and not (folder.parent / f"{folder.name}.partial").exists()


def test_a_host_store_larger_than_memory_is_refused_with_the_way_out(monkeypatch):
    from stem_hf import offload

    monkeypatch.setattr(offload, "available_memory", lambda: 1000)
    with pytest.raises(MemoryError, match="stem-hf offload-store"):
        StemOffloadEngine(sensitive_model(table_dtype="bfloat16"))


def test_cli_writes_the_store_and_converts_with_one(tmp_path, capsys):
    _cli_source(tmp_path)
    out = tmp_path / "out"
    main(["convert", str(tmp_path / "src"), str(out), "--init", "projected", "--refit", "none", "--stem-layers",
          "1/2", "--offload-store", "--max-shard-size", "5000", "--calibration", "--heldout"])  # fmt: skip
    assert (out / STORE_NAME).is_file() and len(list(out.glob("stem-tables-*"))) == 2
    os.remove(out / STORE_NAME)
    main(["offload-store", str(out)])
    assert f"wrote {out / STORE_NAME}" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not a STEM"):
        main(["offload-store", str(tmp_path / "src")])  # the dense source's folder: refused from its config
    with pytest.raises(ValueError, match="--max-shard-size 'big'"):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "x"), "--max-shard-size", "big"])


@pytest.mark.slow
def test_the_scale_benchmark_runs_every_step_quickly(tmp_path):
    script = Path(__file__).parents[1] / "benchmarks" / "bench_scale.py"
    result = tmp_path / "quick.json"
    subprocess.run(
        [sys.executable, str(script), "--quick", "--work", str(tmp_path / "work"), "--out", str(result)],
        check=True,
        capture_output=True,
    )
    quick = json.loads(result.read_text())["quick"]
    assert all(run["same_ids_as_own_tables"] and run["generate_matches_decode"] for run in quick["serve"].values())
    tables = quick["convert_streamed"]["table_GiB"]
    assert quick["serve"]["memory"]["anon_growth_engine_GiB"] >= 0.9 * tables  # a copy in memory
    assert quick["serve"]["mapped"]["anon_growth_engine_GiB"] <= 0.1 * tables  # a map
    assert not os.listdir(tmp_path / "work")  # removed without --keep


def test_available_memory_heeds_a_container_limit(tmp_path, monkeypatch):
    from stem_hf import system

    def write(folder, **files):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name.replace("_", ".", 1)).write_text(text)

    monkeypatch.setattr(system, "_cgroup_paths", lambda: {"": "/job/task"})
    assert system._cgroup_room(str(tmp_path)) is None  # no limit files
    write(tmp_path / "job" / "task", memory_max="max\n", memory_current="600\n", memory_stat="inactive_file 150\n")
    assert system._cgroup_room(str(tmp_path)) is None  # v2 without a limit
    write(tmp_path / "job", memory_max="5000\n", memory_current="4000\n", memory_stat="inactive_file 100\n")
    assert system._cgroup_room(str(tmp_path)) == 5000 - 4000 + 100  # the job's limit binds its task
    write(tmp_path / "job" / "task", memory_max="1000\n")
    assert system._cgroup_room(str(tmp_path)) == 1000 - 600 + 150  # droppable page cache counts as room
    monkeypatch.setattr(system, "_cgroup_paths", lambda: {"memory": "/slurm/job"})  # v1
    limit = "memory_limit_in_bytes"
    write(tmp_path / "memory" / "slurm" / "job", **{limit: "9223372036854771712\n"}, memory_usage_in_bytes="600\n",
          memory_stat="hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 50\n")  # fmt: skip
    assert system._cgroup_room(str(tmp_path)) is None  # v1's "no limit"
    (tmp_path / "memory" / "slurm" / "job" / "memory.stat").write_text(
        "hierarchical_memory_limit 2000\ntotal_inactive_file 50\n"
    )
    assert system._cgroup_room(str(tmp_path)) == 2000 - 600 + 50  # a parent's limit, through the hierarchy
    monkeypatch.setattr(system, "_cgroup_room", lambda: 1)
    assert system.available_memory() == 1


def test_a_failed_store_write_leaves_no_partial_file_and_a_full_disk_is_refused_first(saved, monkeypatch):
    from collections import namedtuple

    from stem_hf import checkpoint_stem

    folder, _ = saved
    monkeypatch.setattr(checkpoint_stem, "WRITE_BLOCK_BYTES", 1000)
    calls, original = [], StemSafetensorsWriter.write

    def fail(self, *args):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        original(self, *args)

    monkeypatch.setattr(StemSafetensorsWriter, "write", fail)
    with pytest.raises(KeyboardInterrupt):
        write_offload_store(folder)
    assert not [p for p in os.listdir(folder) if "offload" in p]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OSError, match="the offload store takes .* has 100 B free"):
        write_offload_store(folder)


def test_a_conversion_is_refused_before_loading_where_the_disk_cannot_hold_its_tables(tmp_path, monkeypatch):
    from collections import namedtuple

    convert_module = sys.modules["stem_hf.conversion.convert"]
    _cli_source(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    monkeypatch.setattr(convert_module, "open_source", lambda *a: pytest.fail("loaded before the disk check"))
    with pytest.raises(OSError, match="the checkpoint and its offload store take .* has 100 B free"):
        convert(str(tmp_path / "src"), tmp_path / "out" / "deeper", stem_layers="1/2", init="projected",
                refit="none", offload_store=True)  # fmt: skip
    with pytest.raises(ValueError, match="give an output folder"):
        convert(str(tmp_path / "src"), None, init="projected", refit="none", offload_store=True)
    assert not (tmp_path / "out").exists()


def test_a_table_stream_left_without_its_weights_commits_nothing(tmp_path):
    model = sensitive_model(table_dtype="bfloat16")
    with pytest.raises(RuntimeError, match="ended before save_weights"):
        with StemTableStream(tmp_path / "out", model) as stream:
            stream.write(1, 0, torch.zeros(4, 64))
    assert os.listdir(tmp_path) == []
