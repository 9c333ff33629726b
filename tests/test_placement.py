"""Tables stay in host memory when the dense part goes to an accelerator or is offloaded. Without a GPU the device-map
logic is checked with transformers' own expansion of the map, and the load and forward paths run with device maps on
CPU; where CUDA is available, the device-map loads also run on it."""

import copy
import json
import os
import pickle
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from transformers.integrations.accelerate import expand_device_map

from stem_hf import StemForCausalLM, checkpoint_stem, modeling_stem, offload
from stem_hf.checkpoint_stem import device_map_keeping_tables_on_cpu
from stem_hf.compat_stem import CACHE_ARG
from stem_hf.host_syncs import HostSyncCounter
from stem_hf.modeling_stem import StemTable, StemTableRows, copies_grad_behind
from tests.conftest import benchmark_script, mapped_file, sensitive_model, tiny_model

TABLE, DENSE = "model.stem_tables.1.weight", "model.layers.1.mlp.gate_proj.weight"


def _placement(device_map: dict) -> dict:
    return expand_device_map(device_map, [TABLE, DENSE, "lm_head.weight", "model.rotary_emb.inv_freq"])


def test_single_device_maps_leave_tables_out():
    config = tiny_model().config
    for device_map in ("cuda:0", 0, torch.device("cuda", 0), {"": "cuda:0"}, {"model": 0, "lm_head": 0}):
        result = device_map_keeping_tables_on_cpu(StemForCausalLM, config, device_map, None)
        assert not any(k == "" or "stem_tables" in k or k == "model" for k in result), result
        placement = _placement(result)
        assert placement[TABLE] == "cpu"  # unmapped parameters load on CPU, with no accelerate hook
        assert str(placement[DENSE]) in ("cuda:0", "0") and str(placement["lm_head.weight"]) in ("cuda:0", "0")
        assert str(placement["model.rotary_emb.inv_freq"]) in ("cuda:0", "0")


def test_explicit_table_entries_are_dropped_and_split_maps_kept():
    config = tiny_model().config
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 0,
        "model.layers.2": 1,
        "model.layers.3": 1,
        "model.norm": 1,
        "model.rotary_emb": 0,
        "model.stem_tables": 1,
        "lm_head": 1,
    }
    result = device_map_keeping_tables_on_cpu(StemForCausalLM, config, device_map, None)
    assert result == {k: v for k, v in device_map.items() if k != "model.stem_tables"}
    assert _placement(result)[TABLE] == "cpu"


def test_the_map_is_rewritten_only_when_tables_stay_on_cpu(tmp_path, monkeypatch):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    calls = []
    rewrite = device_map_keeping_tables_on_cpu
    monkeypatch.setattr(
        checkpoint_stem,
        "device_map_keeping_tables_on_cpu",
        lambda cls, *args: calls.append(args[1]) or rewrite(cls, *args),
    )
    StemForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"})
    assert calls == [{"": "cpu"}]
    # The caller's override of the saved config is what decides, as it is what the loaded model gets.
    reloaded = StemForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"}, keep_tables_on_cpu=False)
    assert calls == [{"": "cpu"}] and reloaded.config.keep_tables_on_cpu is False


def test_auto_map_is_sized_in_the_load_dtype():
    config = tiny_model(vocab_size=4096).config
    dense_params = sum(p.numel() for n, p in tiny_model(vocab_size=4096).named_parameters() if "stem_tables" not in n)
    budget = {"cpu": int(dense_params * 2 * 1.3)}  # fits in bf16, not in fp32
    bf16 = device_map_keeping_tables_on_cpu(StemForCausalLM, config, "auto", budget, torch.bfloat16)
    fp32 = device_map_keeping_tables_on_cpu(StemForCausalLM, config, "auto", budget, torch.float32)
    assert "disk" not in bf16.values() and "disk" in fp32.values()


def test_rows_of_a_table_on_another_device_take_the_deduplicating_path(monkeypatch):
    model = tiny_model()
    seen = []
    monkeypatch.setattr(StemTableRows, "host_rows", lambda self, *args: seen.append(self.stem_input_ids.device.type))
    StemTableRows(model.model.stem_tables, torch.zeros(1, 3, dtype=torch.long, device="meta"))[1]
    StemTableRows(model.model.stem_tables, torch.zeros(1, 3, dtype=torch.long))[1]
    assert seen == ["meta"]  # ids elsewhere than the table: deduplicate; same device: plain lookup


def _host_served(monkeypatch, pipelined: bool = True) -> list[tuple[int, str]]:
    """Serves every table through the host path a model on an accelerator takes, here with the ids on the CPU too:
    `pipelined`, every forward's rows fetched ahead by the worker thread (as training forwards, and inference forwards
    of more than `HOST_AT_ONCE_MAX_IDS` distinct ids, are); else as by default, where these small inference forwards
    fetch every table's rows at once on their own thread. Returns the (layer, thread) of each fetch as it happens."""
    if pipelined:
        monkeypatch.setattr(modeling_stem, "HOST_AT_ONCE_MAX_IDS", 0)
    fetches = []
    fetch = StemTableRows._fetch

    def recorded(self, table, unique, main):
        layer = next(int(k) for k, t in self.tables.items() if t is table)
        fetches.append((layer, threading.current_thread().name.split("_")[0]))
        return fetch(self, table, unique, main)

    monkeypatch.setattr(StemTableRows, "host_served", lambda self, table: True)
    monkeypatch.setattr(StemTableRows, "_fetch", recorded)
    return fetches


def test_a_host_table_gradient_crosses_behind_the_backward_only_where_nothing_reads_it_before_the_backward_ends():
    """From CUDA a host table's sparse gradient is copied while the backward goes on (test_gpu holds the copies back
    and checks they arrive): not where autograd adds it to another gradient at once or anything reads it in the
    backward."""
    weight = StemTable(5, 3).weight
    with torch.no_grad():  # as a backward runs its nodes
        assert not copies_grad_behind(weight)  # not marked (`copy_table_grads_behind`: StemTrainer's own loss)
        weight.stem_grad_copies_behind = True
        assert copies_grad_behind(weight)
    assert not copies_grad_behind(weight)  # grad mode on: a backward with `create_graph` clones the gradient at once
    with torch.no_grad():
        assert copies_grad_behind(weight)
        for register in (weight.register_hook, weight.register_post_accumulate_grad_hook):
            hook = register(lambda x: None)
            assert not copies_grad_behind(weight)
            hook.remove()
            assert copies_grad_behind(weight)
        # One of this backward still crossing (marked with its graph task: outside a backward, -1): autograd would
        # add to it at once. A stale mark, of a backward that raised before its end, does not count.
        weight.stem_grad_crossing = torch._C._current_graph_task_id()
        assert not copies_grad_behind(weight)
        weight.stem_grad_crossing = 12345
        assert copies_grad_behind(weight)
        del weight.stem_grad_crossing
        with torch.autograd.detect_anomaly():  # reads each node's outputs as they come
            assert not copies_grad_behind(weight)
        with HostSyncCounter():  # a dispatch mode: autograd clones a sparse gradient under it
            assert not copies_grad_behind(weight)
        assert copies_grad_behind(weight)
        weight.grad = torch.zeros_like(weight)
        assert not copies_grad_behind(weight)


@pytest.mark.parametrize("sparse", [False, True])
def test_host_rows_equal_the_lookup_with_the_gradient_of_a_hand_computation(monkeypatch, sparse):
    fetches = _host_served(monkeypatch)
    model = tiny_model(table_dtype="float32", stem_layers=[1, 2, 3])
    table = model.model.stem_tables["2"]
    table.sparse = sparse
    ids = torch.tensor([[5, 9, 5, 2], [9, 9, 1, 5]])
    rows = StemTableRows(model.model.stem_tables, ids)
    gathered = rows[2]
    assert torch.equal(gathered, table.weight[ids])
    assert torch.equal(rows.distinct()[0], torch.tensor([1, 2, 5, 9]))
    for ahead in rows._ahead.values():  # layer 3's fetch started before layer 3 asks; let the worker record it
        ahead.result()
    assert fetches == [(2, "stem-host-rows"), (3, "stem-host-rows")]  # layer 3's rows fetched ahead, on the worker
    gathered.pow(2).sum().backward()
    expected = torch.zeros_like(table.weight)
    for i in ids.flatten():
        expected[i] += 2 * table.weight[i].detach()
    assert table.weight.grad.is_sparse is sparse
    torch.testing.assert_close(table.weight.grad.to_dense(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_model_served_from_host_tables_equals_resident_tables(monkeypatch, pipelined):
    """Logits, greedy tokens, gradients (with activation checkpointing) and the update of a training run are those of
    the same model reading its tables on the device: every forward fetched by the worker thread (`pipelined`), or as
    by default, where these small inference forwards fetch every table's rows at once on their own thread (training
    forwards are pipelined either way)."""
    torch.manual_seed(0)
    resident = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_logits = resident(ids).logits
    expected_tokens = resident.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    resident.train()
    resident.gradient_checkpointing_enable()
    resident(input_ids=ids, labels=ids).loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in resident.named_parameters()}

    fetches = _host_served(monkeypatch, pipelined)
    host = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    with torch.no_grad():
        assert torch.equal(host(ids).logits, expected_logits)
    if pipelined:
        assert [layer for layer, _ in fetches] == [1, 2, 3] and {t for _, t in fetches} == {"stem-host-rows"}
    else:
        assert fetches == []  # none handed to the worker
    assert torch.equal(host.generate(ids, max_new_tokens=6, do_sample=False), expected_tokens)
    host.train()
    host.gradient_checkpointing_enable()
    fetches.clear()
    host(input_ids=ids, labels=ids).loss.backward()
    # Forward: each layer once, on the worker; checkpointing's recompute fetches again, in the backward's thread.
    assert sorted(fetches[:3]) == [(1, "stem-host-rows"), (2, "stem-host-rows"), (3, "stem-host-rows")]
    assert sorted(layer for layer, _ in fetches[3:]) == [1, 2, 3]
    assert "stem-host-rows" not in {thread for _, thread in fetches[3:]}
    for name, param in host.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_small_inference_forward_fetches_every_host_tables_rows_at_once_on_its_own_thread(monkeypatch):
    """At most `HOST_AT_ONCE_MAX_IDS` distinct ids, in inference (a decoding step): at the first ask, the forward's own
    thread gathers every host table's rows, into one buffer per table dtype, each with one copy; nothing goes to the
    worker. Rows are the tables'; a layer asked again is fetched again. With one id more, or with gradients on (a
    training forward, which waits for each table's write behind layer by layer), the worker fetches ahead instead."""
    fetches = _host_served(monkeypatch, pipelined=False)
    monkeypatch.setattr(modeling_stem, "HOST_AT_ONCE_MAX_IDS", 3)
    gathers, gather = [], modeling_stem.gather_rows
    monkeypatch.setattr(
        modeling_stem, "gather_rows", lambda *a, **k: gathers.append(threading.current_thread().name) or gather(*a, **k)
    )
    copies, copy_staged = [], modeling_stem.copy_staged
    monkeypatch.setattr(
        modeling_stem, "copy_staged", lambda staged, *a: copies.append(staged.shape) or copy_staged(staged, *a)
    )
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    tables = model.model.stem_tables
    tables["2"].to(torch.bfloat16)  # a table kept in bf16 beside float32 ones: two buffers
    ids = torch.tensor([[5, 9, 5, 2], [9, 9, 2, 5]])  # 3 distinct
    width = model.config.intermediate_size
    with torch.no_grad():
        rows = StemTableRows(tables, ids)
        got = rows[1]
        assert fetches == [] and gathers == ["MainThread"] * 3
        assert copies == [(2, 3, width), (1, 3, width)]  # layers 1 and 3 (float32) in one buffer, layer 2 in one
        assert sorted(rows._ahead) == [2, 3] and not any(isinstance(f, Future) for f in rows._ahead.values())
        for layer in (2, 3):
            assert torch.equal(rows[layer], tables[str(layer)].weight[ids])
        assert len(gathers) == 3 and torch.equal(got, tables["1"].weight[ids])
        again = rows[1]  # asked again: fetched again, alone
        assert gathers == ["MainThread"] * 4 and copies[2:] == [(3, width)] and torch.equal(again, got)
        assert fetches == [(1, "MainThread")]

    for grad, forward_ids in ((False, torch.tensor([[5, 9, 5, 2, 40]])), (True, ids)):  # 4 distinct; a training forward
        gathers.clear()
        fetches.clear()
        with torch.set_grad_enabled(grad):
            rows = StemTableRows(tables, forward_ids)
            rows[1]
        for ahead in rows._ahead.values():
            ahead.result()
        assert [layer for layer, _ in fetches] == [1, 2, 3] and set(gathers) == {"stem-host-rows_0"}


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_forward_starts_fetching_its_host_rows_before_its_first_layer(monkeypatch, pipelined):
    """A forward's ids are known before any compute: it starts its host tables' fetches (the first STEM layers' on
    the worker, or every table's at once) before layer 0, a dense layer, runs, so that they overlap it."""
    _host_served(monkeypatch, pipelined)
    events = []
    for name in ("_fetch_ahead", "_fetch_at_once"):
        original = getattr(StemTableRows, name)
        monkeypatch.setattr(StemTableRows, name, lambda self, *a, f=original, n=name: events.append(n) or f(self, *a))
    model = sensitive_model(stem_layers=[1, 2, 3])
    for i in (0, 1):
        model.model.layers[i].register_forward_pre_hook(lambda module, args, i=i: events.append(f"layer {i}"))
    with torch.no_grad():
        expected = model(torch.tensor([[5, 9, 5, 2]])).logits
    assert events[:3] == ["_fetch_ahead" if pipelined else "_fetch_at_once", "layer 0", "layer 1"]
    assert events.count("_fetch_at_once") == (0 if pipelined else 1)  # every table's fetched by the first
    monkeypatch.undo()  # the same model's tables as resident ones: the same logits
    with torch.no_grad():
        assert torch.equal(sensitive_model(stem_layers=[1, 2, 3])(torch.tensor([[5, 9, 5, 2]])).logits, expected)


def test_device_map_load_keeps_tables_mapped_and_logits_equal(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    input_ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        expected = model(input_ids).logits
    for device_map in ("auto", "cpu", {"": "cpu"}):
        reloaded = StemForCausalLM.from_pretrained(tmp_path, device_map=device_map)
        table = reloaded.model.stem_tables["1"].weight
        assert table.device.type == "cpu" and table.dtype == torch.bfloat16
        device = reloaded.get_input_embeddings().weight.device  # "auto" on a CUDA machine: cuda:0
        with torch.no_grad():
            logits = reloaded(input_ids.to(device)).logits.cpu()
        if device.type == "cpu":
            assert torch.equal(logits, expected)
        else:  # the GPU's kernels sum in other orders than the CPU's
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-3 * expected.abs().max().item())
        out = reloaded.generate(input_ids.to(device), max_new_tokens=3, do_sample=False)
        assert out.shape == (2, 10)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_auto_map_with_disk_offload_keeps_tables_mapped_and_outputs_equal(tmp_path, device):
    """device_map="auto" with a max_memory the dense part does not fit: accelerate offloads dense layers (to disk; on
    CUDA also to the CPU), and the tables stay copy-on-write maps of their files, never accelerate offload weights,
    which accelerate would load whole onto the execution device at every forward."""
    folder, offload = tmp_path / "ckpt", tmp_path / "offload"
    sensitive_model(vocab_size=4096, intermediate_size=256).save_pretrained(folder)
    plain = StemForCausalLM.from_pretrained(folder, device_map=None if device == "cpu" else {"": 0})
    dense = sum(p.numel() * p.element_size() for n, p in plain.named_parameters() if "stem_tables" not in n)
    # accelerate keeps room for the largest module (the embedding) on the main device: on CPU the embedding and layers
    # 0-1 stay, the rest goes to disk; on CUDA they go to the GPU, layer 2 to the CPU and the rest to disk.
    budget = {"cpu": int(0.9 * dense)} if device == "cpu" else {0: int(0.9 * dense), "cpu": int(0.48 * dense)}
    model = StemForCausalLM.from_pretrained(folder, device_map="auto", max_memory=budget, offload_folder=offload)

    tables = [f"model.stem_tables.{i}.weight" for i in model.config.stem_layers]
    device_map = model.hf_device_map
    placement = expand_device_map(device_map, [name for name, _ in model.named_parameters()])
    assert "disk" in device_map.values(), f"nothing offloaded to disk, the test proves nothing: {device_map}"
    # A STEM layer's dense weights are offloaded (on CUDA, "cpu" is offloading too): its table serves a hooked layer.
    offloading_devices = {"disk"} if device == "cpu" else {"cpu", "disk"}
    stem_dense = [placement[f"model.layers.{i}.mlp.gate_proj.weight"] for i in model.config.stem_layers]
    assert offloading_devices & set(stem_dense), device_map
    if device == "cuda":
        assert {0, "cpu", "disk"} <= set(device_map.values()), device_map
    assert not any(k in ("", "model") or "stem_tables" in k for k in device_map), device_map
    assert all(placement[name] == "cpu" for name in tables)  # outside the map: loaded on CPU, with no hook

    hooks = {name: module._hf_hook for name, module in model.named_modules() if hasattr(module, "_hf_hook")}
    offloading = [hook for hook in hooks.values() if getattr(hook, "offload", False)]
    assert offloading and not any("stem_tables" in name for name in hooks)
    offloaded = {key for hook in offloading for key in hook.weights_map.dataset.all_keys}
    assert "lm_head.weight" in offloaded and not any("stem_tables" in key for key in offloaded), sorted(offloaded)
    # transformers serves disk-offloaded weights from the checkpoint's own files; anything it wrote is dense.
    for index in offload.rglob("index.json"):
        assert not any("stem_tables" in key for key in json.loads(index.read_text())), index
    assert not any("stem_tables" in path.name for path in offload.rglob("*"))

    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for name in tables:
        table = model.get_parameter(name)
        assert table.device.type == "cpu" and table.dtype == torch.bfloat16
        assert mapped_file(table) == os.path.realpath(folder / weight_map[name]), f"{name} is not a map of its file"
        assert torch.equal(table, plain.get_parameter(name))

    # Same checkpoint, same device, same dtype: offloaded weights reach the same kernels bit for bit, so no tolerance.
    ids = torch.randint(3, 4096, (2, 9)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=True)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    got, expected = model.generate(ids, **kwargs), plain.generate(ids, **kwargs)
    assert getattr(got, CACHE_ARG) is not None and got.sequences.shape == (2, 17)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=0)


@pytest.mark.parametrize("sparse_table_grads", [None, False])  # StemTrainer's default (row-only), and dense
def test_training_from_host_tables_equals_training_resident_ones(tmp_path, monkeypatch, sparse_table_grads):
    from datasets import Dataset
    from transformers import TrainingArguments

    from stem_hf.training import StemTrainer

    ids = torch.randint(3, 96, (8, 10), generator=torch.Generator().manual_seed(2)).tolist()
    data = Dataset.from_list([{"input_ids": row, "labels": row} for row in ids])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-2, max_grad_norm=0.5, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    models = []
    for host in (False, True):
        if host:
            _host_served(monkeypatch)
        torch.manual_seed(0)
        model = sensitive_model(stem_layers=[1, 2, 3])
        trainer = StemTrainer(model=model, args=args, train_dataset=data, sparse_table_grads=sparse_table_grads)
        trainer.train()
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    initial = sensitive_model(stem_layers=[1, 2, 3]).model.stem_tables["2"].weight.float()
    assert not torch.equal(models[1].model.stem_tables["2"].weight, initial)  # the tables did train


def test_host_table_row_gradients_are_stepped_and_clipped_without_a_coalesce(monkeypatch):
    """A host table's gradient has distinct sorted rows; the optimizer and clipping take them as they are (autograd
    drops the coalesced flag, and a coalesce on the host copies every row again), with the update of coalesced ones."""
    from stem_hf.training import RowSparseAdamW, clip_grad_norm, param_groups, use_sparse_table_grads

    _host_served(monkeypatch)
    ids = torch.tensor([[5, 9, 5, 2, 40], [9, 9, 1, 5, 77]])
    torch.manual_seed(0)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    use_sparse_table_grads(model)
    model(input_ids=ids, labels=ids).loss.backward()
    reference = copy.deepcopy(model)  # the weights; its gradients are the model's, coalesced
    for param, copied in zip(model.parameters(), reference.parameters(), strict=True):
        if param.grad is not None:
            copied.grad = param.grad.coalesce() if param.grad.is_sparse else param.grad.clone()
    coalesced = []
    coalesce = torch.Tensor.coalesce
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda self: coalesced.append(self) or coalesce(self))
    norms = []
    for m in (model, reference):
        norms.append(clip_grad_norm(m.parameters(), 0.5))
        RowSparseAdamW(param_groups(m, 1e-2, 0.1, row_sparse_tables=True)).step()
    assert not coalesced
    assert torch.equal(norms[0], norms[1])
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_host_row_worker_of_its_own(monkeypatch):
    """The parent's worker thread does not survive a fork: given the parent's executor, a child's fetch would wait
    forever. (A whole forward is not run in the child: torch's own thread pool does not survive a fork either.)"""
    from stem_hf import modeling_stem

    _host_served(monkeypatch)
    with torch.no_grad():
        sensitive_model(stem_layers=[1, 2, 3])(torch.tensor([[5, 6, 7]]))  # the parent's worker now exists
    assert modeling_stem._ROW_WORKER is not None
    assert _in_forked_child(lambda: modeling_stem._row_worker().submit(lambda: 42).result(timeout=10) == 42)


def _in_forked_child(check) -> bool:
    """What `check()` returns in a forked child (False if it raises)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"1" if check() else b"0")
        except BaseException:
            os.write(write, b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    return answer == b"1"


def test_tables_the_worker_cannot_serve_are_looked_up_by_the_table_itself(monkeypatch):
    """A hooked table computes its rows in its own forward (the hook runs), and a table that is not in host memory
    (here on the meta device, for another accelerator) is never handed to the worker, which reads host memory."""
    fetches = _host_served(monkeypatch)
    model = sensitive_model(stem_layers=[1, 2, 3])
    ids = torch.tensor([[5, 9, 5, 2]])
    calls = []
    model.model.stem_tables["2"].register_forward_pre_hook(lambda module, args: calls.append(args[0].tolist()))
    rows = StemTableRows(model.model.stem_tables, ids)
    assert torch.equal(rows[2], model.model.stem_tables["2"].weight[ids]) and calls == [[2, 5, 9]]
    assert fetches == []  # layer 2's rows came from its own forward, not the worker
    assert rows.pipelined(model.model.stem_tables["1"])
    assert not rows.pipelined(torch.nn.Embedding(4, 2, device="meta"))


def _adamw_steps(model, ids, write_behind: bool, steps: int = 3):
    from stem_hf.training import RowSparseAdamW, param_groups, use_sparse_table_grads

    use_sparse_table_grads(model.train())
    optimizer = RowSparseAdamW(param_groups(model, 5e-2, row_sparse_tables=True), write_behind=write_behind)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        model.zero_grad()
    return optimizer


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_forward_after_a_write_behind_step_waits_for_the_tables_it_reads(monkeypatch, pipelined):
    """`step` returns while the host tables are still being written (the writer is held here); the next forward's
    row fetch (on the worker where `pipelined`, else every table's at once on the forward's thread), a state dict and
    the optimizer wait for the writes, so everything equals a run that wrote before `step` returned. A copy of the
    model taken meanwhile carries no pending write."""
    from stem_hf.training import RowSparseAdamW

    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    _adamw_steps(reference, ids, write_behind=False)
    with torch.no_grad():
        expected = reference(ids).logits

    fetches = _host_served(monkeypatch, pipelined)
    writers, holding, release, free = [], threading.Event(), threading.Event(), [6]
    update = RowSparseAdamW._row_update

    def held(self, param, *args):
        writers.append(threading.current_thread().name.split("_")[0])
        if len(writers) > free[0]:  # the third step's writes (two before, three tables each) wait to be released
            holding.set()
            assert release.wait(timeout=30)
        update(self, param, *args)

    monkeypatch.setattr(RowSparseAdamW, "_row_update", held)
    torch.manual_seed(0)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    optimizer = _adamw_steps(model, ids, write_behind=True)
    assert holding.wait(timeout=30)
    assert set(writers) == {"stem-table-writer"} and len(writers) == 7  # the 7th is held, the others queue behind
    table = model.model.stem_tables["1"]
    assert not table.weight.stem_pending_write.done()  # step() has returned; the write has not
    threading.Timer(0.3, release.set).start()
    copied = copy.deepcopy(table)  # waits for the write: a copy holds the written rows, and no pending write
    assert not hasattr(copied.weight, "stem_pending_write")
    torch.testing.assert_close(copied.weight, reference.model.stem_tables["1"].weight, rtol=0, atol=0)
    fetches.clear()
    with torch.no_grad():
        got = model(ids).logits  # the fetch waits for each table's write
    assert {t for _, t in fetches} == ({"stem-host-rows"} if pipelined else set())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(writers) == 9
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert not any(hasattr(t.weight, "stem_pending_write") for t in model.model.stem_tables.values())  # done: gone

    # A state dict loaded while a write is held (as Trainer's load_best_model_at_end may): the loaded rows stay.
    saved = copy.deepcopy(model.state_dict())
    release.clear()
    holding.clear()
    writers.clear()
    free[0] = 0
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert holding.wait(timeout=30) and not table.weight.stem_pending_write.done()
    threading.Timer(0.3, release.set).start()
    model.load_state_dict(saved)
    optimizer.settle()
    torch.testing.assert_close(table.weight, saved["model.stem_tables.1.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("pipelined", [True, False])
def test_an_error_in_a_write_behind_reaches_the_next_forward(monkeypatch, pipelined):
    from stem_hf.training import RowSparseAdamW

    _host_served(monkeypatch, pipelined)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    ids = torch.tensor([[5, 6, 7, 8]])
    optimizer = _adamw_steps(model, ids, write_behind=True, steps=1)
    optimizer.settle()

    def broken(*args):
        raise RuntimeError("disk full while writing rows")

    monkeypatch.setattr(RowSparseAdamW, "_update", staticmethod(broken))  # the chunked rows' update
    monkeypatch.setattr(RowSparseAdamW, "_fused_rows", broken)  # float32 host rows
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="disk full while writing rows"), torch.no_grad():
        model(ids)
    with pytest.raises(RuntimeError, match="disk full while writing rows"):
        optimizer.settle()


def test_settle_waits_for_every_write_and_raises_the_first_error_once(monkeypatch):
    """The first table's write fails, the later ones are slow: settle() raises only once every write is done (none
    still changes a table or the optimizer's state), and the markers are gone after it."""
    from stem_hf.training import RowSparseAdamW

    _host_served(monkeypatch)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    ids = torch.tensor([[5, 6, 7, 8]])
    optimizer = _adamw_steps(model, ids, write_behind=True, steps=1)
    optimizer.settle()
    tables = [model.model.stem_tables[k].weight for k in ("1", "2", "3")]
    before = [t.detach().clone() for t in tables]
    update, done = RowSparseAdamW._row_update, []

    def failing_then_slow(self, param, *args):
        if param is tables[0]:
            raise RuntimeError("disk full while writing rows")
        time.sleep(0.2)
        update(self, param, *args)
        done.append(param)

    monkeypatch.setattr(RowSparseAdamW, "_row_update", failing_then_slow)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="disk full while writing rows"):
        optimizer.settle()
    assert len(done) == 2 and torch.equal(tables[0], before[0])
    assert not any(torch.equal(t, b) for t, b in zip(tables[1:], before[1:], strict=True))
    assert not any(hasattr(t, "stem_pending_write") for t in tables)
    optimizer.settle()  # raised once: nothing left
    model.state_dict()


def test_a_copy_or_pickle_of_a_write_behind_optimizer_waits_for_the_writes_and_steps_in_step(monkeypatch):

    _host_served(monkeypatch)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    ids = torch.tensor([[5, 6, 7, 8]])
    release = _held_writes(monkeypatch)
    optimizer = _adamw_steps(model, ids, write_behind=True, steps=1)  # its first writes are held
    for make in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        threading.Timer(0.2, release.set).start()
        other = make(optimizer)
        release.clear()
        table = model.model.stem_tables["2"].weight
        state = other.state_dict()["state"][_index(optimizer, table)]
        assert int(state["rows_seen"]) == 3  # written: the rows of 5, 6, 7 (the last position predicts nothing)
        assert other.write_behind is False and not other._writes
        other.settle()


def _held_writes(monkeypatch) -> threading.Event:
    """Holds every table write on the writer thread until the returned event is set."""
    from stem_hf.training import RowSparseAdamW

    release, update = threading.Event(), RowSparseAdamW._row_update

    def held(self, *args):
        assert release.wait(timeout=30)
        update(self, *args)

    monkeypatch.setattr(RowSparseAdamW, "_row_update", held)
    return release


def _index(optimizer, param) -> int:
    return next(i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]) if p is param)


def test_stem_trainer_writes_host_tables_in_step_unless_asked(tmp_path):
    """Writing behind measured slower than in step with the fused row update (bench_gpu_h100.json): it is opt-in, and
    the old default's None is refused, not read as either."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from stem_hf.training import StemTrainer

    data = Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", max_steps=1)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    assert StemTrainer(model=model, args=args, train_dataset=data).write_behind_tables is False
    assert StemTrainer(model=model, args=args, train_dataset=data, write_behind_tables=True).write_behind_tables
    with pytest.raises(ValueError, match="write_behind_tables: True or False"):
        StemTrainer(model=model, args=args, train_dataset=data, write_behind_tables=None)


def test_stem_trainer_writing_host_tables_behind_trains_as_writing_them_in_step(tmp_path, monkeypatch, row_workers):
    """Accumulation, clipping and a learning-rate schedule that changes every step: the same weights, bit for bit. The
    rows go to the row workers, from the main thread or from the writer."""
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from stem_hf import training
    from stem_hf.training import RowSparseAdamW, StemTrainer

    ids = torch.randint(3, 96, (8, 10), generator=torch.Generator().manual_seed(2)).tolist()
    data = Dataset.from_list([{"input_ids": row, "labels": row} for row in ids])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, max_grad_norm=0.5, warmup_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    _host_served(monkeypatch)
    writers, ended, step_ended = [], [0], threading.Condition()
    update = RowSparseAdamW._row_update

    class StepEnds(TrainerCallback):  # after the optimizer's step, the scheduler's and zero_grad
        def on_step_end(self, *args, **kwargs):
            with step_ended:
                ended[0] += 1
                step_ended.notify_all()

    def recorded(self, *a):
        writers.append(threading.current_thread().name.split("_")[0])
        if writers[-1] == "stem-table-writer":  # write only once the scheduler has moved the rate on
            with step_ended:
                assert step_ended.wait_for(lambda: ended[0] > (len(writers) - 1) // 3, timeout=30)
        update(self, *a)

    kernel, kernels = RowSparseAdamW._fused_kernel, []

    def shared(*a):
        kernels.append(threading.current_thread().name.split("_")[0])
        kernel(*a)

    monkeypatch.setattr(RowSparseAdamW, "_row_update", recorded)
    monkeypatch.setattr(RowSparseAdamW, "_fused_kernel", staticmethod(shared))
    models = []
    for behind in (False, True):
        torch.manual_seed(0)
        model = sensitive_model(stem_layers=[1, 2, 3])
        trainer = StemTrainer(
            model=model, args=args, train_dataset=data, write_behind_tables=behind, callbacks=[StepEnds()]
        )
        writers.clear()
        kernels.clear()
        ended[0] = 0
        trainer.train()
        assert set(writers) == ({"stem-table-writer"} if behind else {"MainThread"}) and len(writers) == 9
        assert not any(hasattr(t.weight, "stem_pending_write") for t in model.model.stem_tables.values())
        assert set(kernels) == {"stem-row-update"} and len(kernels) == 2 * 9  # two shares per table and step
        assert training._ROW_WORKERS is not None and trainer.optimizer.optimizer._row_views == {}  # dropped at the end
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_waits_for_the_writes_behind_and_the_child_gets_a_writer_of_its_own(monkeypatch, row_workers):
    """A DataLoader forks its workers right after a step: no write may be mid-way in the child's copy of the tables,
    and the child, which has no writer thread and no row workers, gets its own."""
    from stem_hf import training

    _host_served(monkeypatch)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    ids = torch.tensor([[5, 6, 7, 8]])
    optimizer = _adamw_steps(model, ids, write_behind=True, steps=1)
    optimizer.settle()
    release = _held_writes(monkeypatch)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    threading.Timer(0.3, release.set).start()

    def child() -> bool:
        tables = model.model.stem_tables.values()
        ok = not any(hasattr(t.weight, "stem_pending_write") for t in tables) and training._TABLE_WRITER is None
        ok = ok and training._ROW_WORKERS is None
        ok = ok and training._row_workers()[0].submit(lambda: 7).result(timeout=10) == 7
        return ok and training._table_writer().submit(lambda: 42).result(timeout=10) == 42

    assert _in_forked_child(child)  # the fork waits for the held writes first
    assert release.is_set()
    assert training._ROW_WORKERS is not None  # the writes shared their rows out: the parent forked with row workers


def test_the_host_decode_benchmark_counts_each_ways_gathers_by_thread(monkeypatch, tmp_path):
    """`benchmarks/bench_host_decode.py` at a few tokens: the host ways and the engine generate resident's tokens, a
    decoding step's gathers run on the forward's thread by default and on the worker when pipelined (one per STEM
    layer), the engine's on the forward's thread for its misses, and the host path is routed only inside its own
    runs."""
    import argparse

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    bench = benchmark_script("bench_host_decode")
    args = argparse.Namespace(shape="tiny", layers=4, dtype="float32", batches=[1, 3], prompt_len=8, new_tokens=3,
                              repeats=1, cache_tokens=64, out=str(tmp_path / "decode.json"))  # fmt: skip
    report, unrouted, at_once = {}, StemTableRows.host_served, modeling_stem.HOST_AT_ONCE_MAX_IDS
    gather = modeling_stem.gather_rows
    bench.run(args, torch.device("cpu"), report)
    assert report["complete"] and json.loads((tmp_path / "decode.json").read_text()) == report
    for batch in (1, 3):
        row = report[f"batch_{batch}"]
        stem_layers = 2  # 1/2 of 4
        assert row["resident"]["gathers_forward_thread"] == row["resident"]["gathers_worker"] == 0
        assert (row["host"]["gathers_forward_thread"], row["host"]["gathers_worker"]) == (stem_layers, 0)
        pipelined = row["host_pipelined"]
        assert (pipelined["gathers_forward_thread"], pipelined["gathers_worker"]) == (0, stem_layers)
        assert all(row[way]["same_tokens_as_resident"] for way in ("host", "host_pipelined", "engine"))
        assert row["engine"]["gathers_forward_thread"] <= 1 and row["engine"]["gathers_worker"] == 0  # misses only
        assert all(row[way]["step_ms"] > 0 and row[way]["python_calls"] > 0 for way in bench.WAYS)
        assert row["dense"]["gathers_forward_thread"] == row["dense"]["gathers_worker"] == 0
        assert row["resident_vs_dense"] == pytest.approx(row["dense"]["step_ms"] / row["resident"]["step_ms"], rel=1e-2)
        assert row["host_vs_resident"] == pytest.approx(row["resident"]["step_ms"] / row["host"]["step_ms"], rel=1e-2)
    assert StemTableRows.host_served is unrouted and modeling_stem.HOST_AT_ONCE_MAX_IDS == at_once  # as before
    assert offload.gather_rows is modeling_stem.gather_rows is gather
