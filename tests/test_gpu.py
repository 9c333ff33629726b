"""The CUDA paths against a CPU reference: tables in host memory with the dense part on the GPU (logits, generations,
gradients, device memory), device-map loads that leave the tables memory-mapped on the host, the offload engine's
side-stream copies, events, pinned staging buffers, device row cache and background gather, and bf16 healing on the
GPU. Every test skips without a CUDA device (CI has none): `bash benchmarks/gpu_check.sh` runs them on one."""

import copy
import gc
import math
import threading

import pytest
import torch

from stem_hf import StemForCausalLM
from stem_hf.offload import StemOffloadEngine, offloaded
from tests.conftest import (
    _converted,
    _mapped_files,
    _opinionated,
    _texts,
    dense_adamw_steps,
    sensitive_model,
    tiny_model,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none visible")

CUDA = torch.device("cuda", 0)
FP32_TOL = 1e-3  # of the logits' scale: CPU and GPU kernels sum in other orders
BF16_TOL = 5e-2  # a bf16 dense part against the fp32 CPU reference


def _ids(shape, vocab=96, seed=0):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _assert_close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    assert got.shape == expected.shape
    assert torch.isfinite(got).all(), "non-finite values from the GPU"
    error, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    assert error <= tol * scale + 1e-6, f"max |difference| {error:.3g} against a scale of {scale:.3g} (tol {tol})"


def _assert_same_greedy(got: torch.Tensor, reference) -> None:
    """Greedy tokens on the GPU equal the CPU reference's, except where the reference's two best logits were a near tie
    at the first step a row parts from it (fp32 summation order may then pick the other)."""
    got, expected = got.cpu(), reference.sequences
    assert got.shape == expected.shape
    prompt = expected.shape[1] - len(reference.scores)
    for row in range(expected.shape[0]):
        differ = (got[row] != expected[row]).nonzero()
        if len(differ) == 0:
            continue
        step = differ[0].item() - prompt
        assert step >= 0, "the prompt changed"
        top = reference.scores[step][row].float().topk(2).values
        assert top[0] - top[1] < 1e-3 * top.abs().max().clamp(min=1), f"row {row} parts at step {step} with no tie"


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(CUDA)


def _table_bytes(model) -> int:
    return sum(t.weight.numel() * t.weight.element_size() for t in model.model.stem_tables.values())


# ----------------------------------------------------------------------------------------------------------------------
# Tables in host memory, the dense part on the GPU


def test_to_cuda_keeps_tables_on_the_host_and_matches_cpu():
    model = sensitive_model(table_dtype="float32", vocab_size=4096, intermediate_size=256)
    ids = _ids((3, 10), vocab=4096)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in a batch
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    reference = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "stem_tables" not in n)
    before = _allocated()
    model.to(CUDA)
    moved = _allocated() - before
    assert all(t.weight.device.type == "cpu" for t in model.model.stem_tables.values())
    assert model.model.embed_tokens.weight.device == CUDA and model.lm_head.weight.device == CUDA
    assert model.model.layers[1].mlp.gate_proj.weight.device == CUDA  # a STEM layer's dense weights
    assert moved < dense_bytes + 2**20 and moved < _table_bytes(model) / 2, (moved, dense_bytes)
    on_cuda = {k: v.to(CUDA) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        logits = model(ids.to(CUDA), attention_mask=mask.to(CUDA)).logits
    assert logits.device == CUDA
    _assert_close(logits, expected, FP32_TOL)
    _assert_same_greedy(model.generate(ids.to(CUDA), **{**kwargs, **on_cuda}), reference)


def test_resident_and_host_tables_give_the_same_logits_on_cuda():
    host = sensitive_model().to(CUDA)
    resident = sensitive_model(keep_tables_on_cpu=False).to(CUDA)
    assert all(t.weight.device == CUDA for t in resident.model.stem_tables.values())
    assert all(t.weight.device.type == "cpu" for t in host.model.stem_tables.values())
    ids = _ids((2, 16)).to(CUDA)
    with torch.no_grad():
        _assert_close(host(ids).logits, resident(ids).logits, 1e-6)


def test_gradients_reach_host_tables_from_a_cuda_forward():
    model = sensitive_model(table_dtype="float32")
    ids = _ids((2, 12))
    cpu = copy.deepcopy(model)
    cpu_loss = cpu(ids, labels=ids).loss
    cpu_loss.backward()
    model.to(CUDA)
    loss = model(ids.to(CUDA), labels=ids.to(CUDA)).loss
    loss.backward()
    assert loss.item() == pytest.approx(cpu_loss.item(), rel=1e-4)
    seen = set(ids[:, :-1].flatten().tolist())  # a row gets a gradient where its token predicts the next one
    for key, table in model.model.stem_tables.items():
        grad = table.weight.grad
        assert grad is not None and grad.device.type == "cpu"
        _assert_close(grad, cpu.model.stem_tables[key].weight.grad, FP32_TOL)
        assert set((grad != 0).any(dim=1).nonzero().flatten().tolist()) == seen  # only the batch's rows
    gate = model.model.layers[1].mlp.gate_proj.weight.grad
    assert gate.device == CUDA
    _assert_close(gate, cpu.model.layers[1].mlp.gate_proj.weight.grad, FP32_TOL)


def test_host_rows_come_ahead_from_the_worker_and_train_with_sparse_gradients_on_cuda(monkeypatch):
    from stem_hf.modeling_stem import StemTableRows

    threads, fetch = [], StemTableRows._fetch  # a training forward: pipelined, however few its ids

    def recorded(self, table, unique, main):
        rows, ready = fetch(self, table, unique, main)
        threads.append((threading.current_thread().name.split("_")[0], ready is not None, rows.device.type))
        return rows, ready

    monkeypatch.setattr(StemTableRows, "_fetch", recorded)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    dense_grads = copy.deepcopy(model).to(CUDA)
    ids = _ids((2, 12))
    dense_grads(ids.to(CUDA), labels=ids.to(CUDA)).loss.backward()
    model.to(CUDA)
    for table in model.model.stem_tables.values():
        table.sparse = True
    threads.clear()
    model(ids.to(CUDA), labels=ids.to(CUDA)).loss.backward()
    assert threads == [("stem-host-rows", True, "cuda")] * 3  # gathered on the worker, copied with an event
    for key, table in model.model.stem_tables.items():
        assert table.weight.grad.is_sparse and table.weight.grad.device.type == "cpu"
        _assert_close(table.weight.grad.to_dense(), dense_grads.model.stem_tables[key].weight.grad, 1e-6)


def test_a_small_inference_forward_copies_every_host_tables_rows_at_once_on_the_side_stream_on_cuda(monkeypatch):
    """An inference forward of at most `HOST_AT_ONCE_MAX_IDS` distinct ids (a decoding step): every host table's rows
    gathered by the forward's thread into pinned memory, one copy per table dtype on the side stream, each waited for
    by the layers that read it (the copies are held back here by a sleep on that stream, so a layer that did not wait
    would read rows not yet there). Logits and greedy tokens equal resident tables'."""
    from stem_hf import modeling_stem
    from stem_hf.modeling_stem import _COPY_STREAMS, _side_stream

    resident = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3], keep_tables_on_cpu=False)
    host = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3])
    for model in (resident, host):
        model.model.stem_tables["2"].to(torch.bfloat16)  # a table in another dtype: a buffer and a copy of its own
        model.to(CUDA)
    assert all(t.weight.device.type == "cpu" for t in host.model.stem_tables.values())
    ids = _ids((2, 12), seed=3).to(CUDA)
    assert len(ids.unique()) <= modeling_stem.HOST_AT_ONCE_MAX_IDS
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected, tokens = resident(ids).logits, resident.generate(ids, **kwargs)
        # The side stream's memory allocated here (an allocation may synchronize, which would end the sleep), with other
        # rows than the held-back forward's: a layer that did not wait would read wrong rows, not stale right ones.
        host((ids + 1) % host.config.vocab_size)
    torch.cuda.synchronize()
    copies, copy_staged = [], modeling_stem.copy_staged

    def held_back(staged, device, main):
        with torch.cuda.stream(_side_stream(_COPY_STREAMS, device)):
            torch.cuda._sleep(100_000_000)  # tens of milliseconds of the side stream before the copy
        rows, ready = copy_staged(staged, device, main)
        copies.append((staged.is_pinned(), tuple(staged.shape), threading.current_thread().name, ready.query()))
        return rows, ready

    monkeypatch.setattr(modeling_stem, "copy_staged", held_back)
    monkeypatch.setattr(modeling_stem.StemTableRows, "_fetch_ahead", lambda *a: pytest.fail("handed to the worker"))
    n, width = len(ids.unique()), host.config.intermediate_size
    with torch.no_grad():
        _assert_close(host(ids).logits, expected, 1e-6)
        assert copies == [(True, (2, n, width), "MainThread", False), (True, (1, n, width), "MainThread", False)]
        assert torch.equal(host.generate(ids, **kwargs), tokens)


@pytest.mark.parametrize("sparse", [True, False])
def test_host_table_gradients_cross_behind_the_backward_yet_arrive_before_it_returns(monkeypatch, sparse):
    """A host table's gradient is copied on a side stream while the backward goes on; the backward returns only once
    it has arrived (the copies are held back here by a sleep on that stream, so a backward that did not wait would
    hand over unfilled memory). A gradient added to one already there (accumulation), a dense one (scattered at once)
    and a table with a gradient hook get blocking copies. Every gradient equals that of blocking copies throughout,
    and so do those of a loss over two forwards (each table used twice in one backward: the second copy waits)."""
    import stem_hf.modeling_stem as modeling
    from stem_hf.training import copy_table_grads_behind

    behind, crossed = modeling._copy_grad_behind, []

    def held_back(weight, host, grad):
        stream = modeling._GRAD_COPY_STREAMS.setdefault(grad.device, torch.cuda.Stream(grad.device))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # tens of milliseconds before the copy starts
        crossed.append(grad.shape)
        behind(weight, host, grad)

    batches = [_ids((2, 12), seed=seed).to(CUDA) for seed in (0, 1)]
    runs = []
    for copies_behind in (True, False):
        torch.manual_seed(0)
        model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3]).to(CUDA)
        tables = list(model.model.stem_tables.values())
        for table in tables:
            table.sparse = sparse
        copy_table_grads_behind(model)  # as StemTrainer marks them for the model's own loss
        hooked = []
        tables[0].weight.register_post_accumulate_grad_hook(lambda w, seen=hooked: seen.append(w.grad.to_dense() + 0))
        if copies_behind:
            monkeypatch.setattr(modeling, "_copy_grad_behind", held_back)
        else:
            monkeypatch.setattr(modeling, "copies_grad_behind", lambda weight: False)
        grads = []
        for ids in batches:  # two micro-batches: the second adds to the first's gradients
            crossed.clear()
            model(ids, labels=ids).loss.backward()
            grads.append([t.weight.grad.to_dense() + 0 for t in tables] + [hooked[-1]])
            if copies_behind:  # the hooked table, every added gradient and dense ones waited; the rest crossed behind
                assert len(crossed) == (2 if ids is batches[0] and sparse else 0)
        model.zero_grad(set_to_none=True)
        crossed.clear()
        (model(batches[0], labels=batches[0]).loss + model(batches[1], labels=batches[1]).loss).backward()
        grads.append([t.weight.grad.to_dense() + 0 for t in tables] + [hooked[-1]])
        if copies_behind:
            assert len(crossed) == (2 if sparse else 0)  # one use of each unhooked table; the other use waited
        monkeypatch.undo()
        runs.append(grads)
    for behind_grads, blocking_grads in zip(*runs, strict=True):
        for got, expected in zip(behind_grads, blocking_grads, strict=True):
            assert got.device.type == "cpu" and torch.equal(got, expected)
    assert runs[0][0][1].abs().sum() > 0  # real gradients


def test_a_bf16_dense_part_on_cuda_with_bf16_host_tables():
    model = sensitive_model()  # tables bf16 (the default table_dtype), dense fp32
    ids = _ids((2, 16))
    with torch.no_grad():
        expected = model(ids).logits
        model.to(CUDA, torch.bfloat16)
        table = model.model.stem_tables["1"].weight
        assert table.device.type == "cpu" and table.dtype == torch.bfloat16
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        logits = model(ids.to(CUDA)).logits
    assert logits.dtype == torch.bfloat16 and logits.device == CUDA
    _assert_close(logits, expected, BF16_TOL)
    out = model.generate(ids.to(CUDA), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 20) and out.device == CUDA


def test_an_out_of_range_id_raises_before_any_cuda_gather():
    model = sensitive_model().to(CUDA)
    with torch.no_grad(), pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[5, 96]], device=CUDA))
    with torch.no_grad():  # a device-side assert would have left the CUDA context unusable
        assert torch.isfinite(model(torch.tensor([[5, 95]], device=CUDA)).logits).all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("device_map", [{"": 0}, "cuda:0", "auto"])
def test_a_cuda_device_map_load_keeps_tables_mapped_in_host_memory(tmp_path, device_map):
    model = tiny_model(vocab_size=4096, intermediate_size=256)
    model.save_pretrained(tmp_path)
    ids = _ids((2, 9), vocab=4096)
    with torch.no_grad():
        expected = model(ids).logits
    before = _allocated()
    reloaded = StemForCausalLM.from_pretrained(tmp_path, device_map=device_map)
    loaded = _allocated() - before
    dense = sum(p.numel() * p.element_size() for n, p in reloaded.named_parameters() if "stem_tables" not in n)
    for key, module in reloaded.model.stem_tables.items():
        assert module.weight.device.type == "cpu" and module.weight.dtype == torch.bfloat16
        assert any("stem-tables-" in f for f in _mapped_files(module.weight)), f"table {key} is not a view on its file"
        assert not hasattr(module, "_hf_hook")  # no accelerate hook: a forward never copies the whole table
    assert reloaded.model.layers[1].mlp.gate_proj.weight.device == CUDA and reloaded.lm_head.weight.device == CUDA
    assert loaded < dense + _table_bytes(reloaded) / 2, (loaded, dense)
    with torch.no_grad():
        _assert_close(reloaded(ids.to(CUDA)).logits, expected, FP32_TOL)
    assert reloaded.generate(ids.to(CUDA), max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (2, 12)


# ----------------------------------------------------------------------------------------------------------------------
# The offload engine


@pytest.mark.parametrize("int8", [False, True])
def test_engine_copies_pinned_staging_on_a_side_stream_and_never_overwrites_rows_in_flight(int8):
    """Twenty fetches of up to 4096 tokens (4 MB) back to back, no synchronization between them: the two pinned
    staging buffers are reused and grown while earlier copies may still run, and each fetch's rows on the device must
    still be exactly the store's."""
    model = sensitive_model(vocab_size=4096, intermediate_size=256).to(CUDA)
    engine = StemOffloadEngine(model, int8=int8)
    assert engine.cuda and engine.device == CUDA
    assert isinstance(engine.stream, torch.cuda.Stream) and engine.stream != torch.cuda.current_stream(CUDA)
    generator = torch.Generator().manual_seed(5)
    fetched = []
    for _ in range(20):
        n = int(torch.randint(1, 4096, (1,), generator=generator))
        ids = torch.randint(0, 4096, (n,), generator=generator).unique()
        rows, scales, ready = engine._fetch(ids)
        assert isinstance(ready, torch.cuda.Event)
        assert rows.device == CUDA and (scales is None) != int8
        fetched.append((ids, rows, scales, ready))
    assert all(buffer[0].is_pinned() for buffer in engine._staging if buffer is not None)
    if int8:
        assert all(buffer[1].is_pinned() for buffer in engine._staging if buffer is not None)
    for ids, rows, scales, ready in fetched:
        ready.synchronize()
        assert ready.query()
        expected_rows, expected_scales = engine.store.gather(ids)
        assert torch.equal(rows.cpu(), expected_rows)
        if int8:
            assert torch.equal(scales.cpu(), expected_scales)
    assert engine.stats["fetched_tokens"] == sum(len(ids) for ids, *_ in fetched)


@pytest.mark.parametrize("cache_tokens", [0, 6, 200])
def test_offloaded_and_host_tables_give_identical_logits_and_generations_on_cuda(cache_tokens):
    model = sensitive_model()
    ids = _ids((3, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        cpu_logits = model(ids, attention_mask=mask).logits
    model.to(CUDA)
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    _assert_close(logits, cpu_logits, FP32_TOL)
    greedy = model.generate(ids, do_sample=False, **kwargs)
    torch.manual_seed(1)
    sampled = model.generate(ids, do_sample=True, top_k=20, **kwargs)
    before = _allocated()
    with offloaded(model, cache_tokens=cache_tokens) as engine:
        assert engine.cuda
        if cache_tokens:
            assert engine.cache.rows.device == CUDA
        with torch.no_grad():
            _assert_close(model(ids, attention_mask=mask).logits, logits, 1e-6)
        assert torch.equal(model.generate(ids, do_sample=False, **kwargs), greedy)
        torch.manual_seed(1)
        assert torch.equal(model.generate(ids, do_sample=True, top_k=20, **kwargs), sampled)
        cache_bytes = 0 if engine.cache is None else engine.cache.rows.numel() * engine.cache.rows.element_size()
        assert _allocated() - before <= cache_bytes + 2**20  # the store stays on the host
    assert engine.stats["forwards"] == 1 + 2 * 8
    prompt = len(torch.unique(ids))
    assert engine.stats["fetched_tokens"] <= 3 * prompt + 2 * 7 * 3
    if cache_tokens == 200:
        assert engine.cache.hit_rate > 0.3


def test_the_row_cache_on_cuda_serves_a_prefetched_prompt():
    model = sensitive_model().to(CUDA)
    ids = _ids((1, 20)).to(CUDA)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, prefill_chunk_size=8)
    expected = model.generate(ids, **kwargs)  # chunked too: the same kernels, so the same tokens exactly
    with offloaded(model, cache_tokens=64) as engine:
        fetched = engine.prefetch(ids)
        assert fetched == len(torch.unique(ids)) and engine.prefetch(ids) == 0
        out = model.generate(ids, **kwargs)
        assert engine.cache.rows.device == CUDA
    assert torch.equal(out, expected)
    assert engine.cache.misses <= 5  # the prompt's chunks all hit; only generated tokens can miss


def test_int8_offload_on_cuda_changes_logits_little():
    model = sensitive_model().to(CUDA)
    ids = _ids((2, 16)).to(CUDA)
    with torch.no_grad():
        expected = model(ids).logits
        with offloaded(model, int8=True):
            got = model(ids).logits
        with offloaded(model, int8=True, cache_tokens=10) as engine:
            cached = [model(ids).logits for _ in range(2)]
    assert engine.cache.scales.device == CUDA and engine.cache.hits > 0
    assert (got - expected).abs().max() < 0.05 * expected.abs().max() and not torch.equal(got, expected)
    for logits in cached:
        _assert_close(logits, got, 1e-6)


@pytest.mark.parametrize("int8", [False, True])
def test_a_planned_prefill_gathers_and_copies_each_next_chunk_in_the_background_on_cuda(int8):
    model = sensitive_model().to(CUDA)
    ids = _ids((2, 21), seed=1).to(CUDA)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, prefill_chunk_size=8)
    with offloaded(model, int8=int8) as reference:
        expected = model.generate(ids, **kwargs)
    assert reference.stats["planned_forwards"] == 0
    with offloaded(model, int8=int8) as engine:
        engine.plan(ids, chunk_size=8)
        out = model.generate(ids, **kwargs)
        assert engine.stats["planned_forwards"] == 3  # chunks of 8, 8 and 5 tokens, each gathered and copied ahead
        assert not engine._plan and engine._ahead is None and engine._worker is not None
        assert all(event is None or isinstance(event, torch.cuda.Event) for event in engine._events)
    assert engine._worker is None
    assert torch.equal(out, expected)


@pytest.mark.parametrize("int8", [False, True])
def test_a_pipelined_prefill_copies_each_layers_rows_on_the_side_stream_ahead_of_it_on_cuda(int8, monkeypatch):
    """A forward of at least `pipeline_ids` distinct ids fetches layer by layer on the worker thread, each layer's
    copy on the side stream waited for by an event: the logits and tokens of the engine's one gather for every layer,
    even with every copy held back on the side stream (a sleep queued before it), so that a missing wait would read
    rows not yet there. By default (`PIPELINE_MIN_IDS`) only a large prefill does; here every forward of 8 distinct
    ids or more."""
    from stem_hf import offload
    from stem_hf.modeling_stem import _COPY_STREAMS, _side_stream
    from stem_hf.offload import PIPELINE_MIN_IDS, StemPipelinedRows

    model = sensitive_model(stem_layers=[0, 1, 2, 3]).to(CUDA)
    ids = _ids((2, 16), seed=2).to(CUDA)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad(), offloaded(model, int8=int8) as one_gather:
        assert one_gather.pipeline_ids == PIPELINE_MIN_IDS > len(ids.unique())  # a prefill this small: one gather
        expected, tokens = model(ids).logits, model.generate(ids, **kwargs)
    fetch = offload.fetch_rows

    def held_back(source, unique, device, main):
        with torch.cuda.stream(_side_stream(_COPY_STREAMS, device)):
            torch.cuda._sleep(100_000_000)  # tens of milliseconds of the side stream before the copy
        return fetch(source, unique, device, main)

    with torch.no_grad(), offloaded(model, int8=int8, pipeline_ids=8) as engine:
        model((ids + 1) % model.config.vocab_size)  # allocates the side stream's memory (see the at-once test)
        torch.cuda.synchronize()
        monkeypatch.setattr(offload, "fetch_rows", held_back)
        rows = engine(ids)
        assert isinstance(rows, StemPipelinedRows) and rows.main == torch.cuda.current_stream(CUDA)
        _, _, ready = engine._fetch_layer(3, rows.unique, rows.main)
        assert isinstance(ready, torch.cuda.Event) and not ready.query()  # held back indeed
        first = rows[0]
        assert first.device == CUDA and len(rows._ahead) == 2  # layers 1 and 2 under way
        _assert_close(model(ids).logits, expected, 1e-6)
        assert torch.equal(model.generate(ids, **kwargs), tokens)


def test_a_cuda_device_map_load_serves_freed_tables_from_the_store(tmp_path):
    model = sensitive_model()
    model.save_pretrained(tmp_path / "ckpt")
    loaded = StemForCausalLM.from_pretrained(tmp_path / "ckpt", device_map={"": 0})
    ids = _ids((2, 12), seed=2)
    with torch.no_grad():
        expected = model(ids).logits
        engine = StemOffloadEngine(loaded, cache_tokens=16, free_tables=True).attach()
        assert engine.device == CUDA and loaded.model.stem_tables["1"].weight.numel() == 0
        _assert_close(loaded(ids.to(CUDA)).logits, expected, FP32_TOL)
        assert engine.prefetch(torch.arange(3, 30)) > 0
        engine.detach()  # rebuilds the freed tables (on the host) from the store
        assert loaded.model.stem_tables["1"].weight.device.type == "cpu"
        _assert_close(loaded(ids.to(CUDA)).logits, expected, FP32_TOL)
    loaded.save_pretrained(tmp_path / "again")
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------------
# Healing on the GPU


def _heal_fixture():
    dense, stem = _converted(init="xavier")
    chunks = [torch.tensor([1, *t[:59]]) for t in _texts(8, 120, seed=7)]
    return dense, stem, chunks


def _kl(dense, stem, chunks, device) -> float:
    from stem_hf.conversion.heal import distillation_loss

    with torch.no_grad():
        kls = [distillation_loss(stem(c[None].to(device)).logits, dense(c[None].to(device)).logits) for c in chunks]
    return sum(kl.item() for kl in kls) / len(kls)


def test_bf16_healing_steps_on_cuda_train_the_host_tables():
    from stem_hf.conversion.heal import heal

    dense, stem, chunks = _heal_fixture()
    kl_before = _kl(dense, stem, chunks, "cpu")
    dense.to(CUDA)
    stem.to(CUDA)
    tables = stem.model.stem_tables
    assert all(t.weight.device.type == "cpu" and t.weight.dtype == torch.float32 for t in tables.values())
    before = {key: t.weight.detach().clone() for key, t in tables.items()}
    seen = []
    hook = stem.model.layers[1].mlp.down_proj.register_forward_hook(  # shared with the blend during healing
        lambda module, args, out: seen.append((out.dtype, out.device.type))
    )
    try:
        info = heal(dense, stem, chunks, 3000, table_lr=3e-2, lr=1e-3, precision="bf16")
    finally:
        hook.remove()
    assert info["heal_precision"] == "bf16"
    assert math.isfinite(info["heal_kl_before"]) and math.isfinite(info["heal_kl_last"])
    assert info["heal_kl_last"] < info["heal_kl_before"]
    assert seen[-1] == (torch.bfloat16, "cuda")  # the last training step ran under autocast on the GPU
    assert all(t.weight.device.type == "cpu" and t.weight.dtype == torch.float32 for t in tables.values())
    assert all(not torch.equal(t.weight, before[key]) for key, t in tables.items())  # rows written back to the host
    assert all(p.dtype == torch.float32 for p in stem.parameters())
    assert stem.model.embed_tokens.weight.device == CUDA
    kl_after = _kl(dense, stem, chunks, CUDA)
    assert math.isfinite(kl_after) and kl_after < 0.7 * kl_before


def test_fp32_healing_on_cuda_starts_where_cpu_healing_does():
    from stem_hf.conversion.heal import heal

    dense, stem, chunks = _heal_fixture()
    gpu_dense, gpu_stem = copy.deepcopy(dense).to(CUDA), copy.deepcopy(stem).to(CUDA)
    cpu_info = heal(dense, stem, chunks, 600, table_lr=3e-2, lr=1e-3)
    gpu_info = heal(gpu_dense, gpu_stem, chunks, 600, table_lr=3e-2, lr=1e-3)
    assert gpu_info["heal_precision"] == cpu_info["heal_precision"] == "fp32"
    assert gpu_info["heal_kl_before"] == pytest.approx(cpu_info["heal_kl_before"], rel=1e-3)
    assert gpu_info["heal_kl_last"] == pytest.approx(cpu_info["heal_kl_last"], rel=0.1)


def test_convert_heals_on_cuda_with_auto_precision_and_saves_a_model_that_loads(tmp_path):
    from stem_hf.conversion import convert
    from stem_hf.conversion.heal import resolve_precision

    expected_precision = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    assert resolve_precision("auto", "cuda") == expected_precision
    stem, report = convert(
        _opinionated("llama"),
        tmp_path / "out",
        stem_layers=[1, 3],
        init="mean",
        calibration=_texts(6, 120, seed=2),
        heldout=_texts(2, 120, seed=3),
        chunk_len=60,
        heal_tokens=600,
        device="cuda",
        heal_options={"precision": "auto"},
    )
    assert report["heal_precision"] == expected_precision
    assert math.isfinite(report["heldout_perplexity_stem"])
    assert stem.model.embed_tokens.weight.device.type == "cuda"
    assert all(t.weight.device.type == "cpu" for t in stem.model.stem_tables.values())
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "out")
    ids = _ids((2, 11), vocab=64)
    with torch.no_grad():
        _assert_close(stem(ids.to(CUDA)).logits, reloaded(ids).logits, FP32_TOL)


def test_a_stem_trainer_on_cuda_writing_host_tables_behind_trains_as_in_step(tmp_path):
    from datasets import Dataset
    from transformers import TrainingArguments

    from stem_hf.training import StemTrainer

    rows = _ids((8, 10), seed=2).tolist()
    data = Dataset.from_list([{"input_ids": row, "labels": row} for row in rows])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, max_grad_norm=0.5, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    models = []
    for behind in (True, False):
        torch.manual_seed(0)
        model = sensitive_model(table_dtype="float32")
        trainer = StemTrainer(model=model, args=args, train_dataset=data, write_behind_tables=behind)
        assert trainer.write_behind_tables is behind
        trainer.train()
        assert all(t.weight.device.type == "cpu" for t in model.model.stem_tables.values())
        models.append(model)
    for a, b in zip(models[1].parameters(), models[0].parameters(), strict=True):
        _assert_close(b.detach().cpu(), a.detach().cpu(), FP32_TOL)


def test_torch_adamw_over_the_host_tables_of_a_cuda_model_is_named(caplog):
    model = tiny_model(table_dtype="float32").to(CUDA).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids((1, 8)).to(CUDA)
    model(ids, labels=ids).loss.backward()
    with caplog.at_level("WARNING"):
        optimizer.step()
    assert "steps STEM tables in host memory with dense gradients" in caplog.text


def test_compiled_row_updates_of_resident_cuda_tables_match_eager_and_host_tables(monkeypatch):
    """Resident tables on the GPU: `RowSparseAdamW(compiled_rows=True)` (a Triton kernel or two), and the default,
    which compiles them on CUDA, against the eager pass; host tables (the fused per-row kernel on the host's workers)
    against both. Three steps, sparse gradients."""
    from stem_hf import training
    from stem_hf.training import RowSparseAdamW, param_groups, use_sparse_table_grads

    compiled_calls = []
    compiled_rows_fn = training._compiled_adamw_rows
    monkeypatch.setattr(training, "_compiled_adamw_rows", lambda: compiled_calls.append(1) or compiled_rows_fn())

    ids = _ids((2, 12), seed=3).to(CUDA)
    models = []
    for resident, compiled in ((True, False), (True, True), (True, None), (False, False)):
        torch.manual_seed(0)
        model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3], keep_tables_on_cpu=not resident)
        model.to(CUDA).train()
        assert all((t.weight.device.type == "cuda") is resident for t in model.model.stem_tables.values())
        use_sparse_table_grads(model)
        optimizer = RowSparseAdamW(param_groups(model, 1e-2, 0.1, row_sparse_tables=True), compiled_rows=compiled)
        compiled_calls.clear()
        for _ in range(3):
            optimizer.zero_grad()
            model(ids, labels=ids).loss.backward()
            optimizer.step()
        compiles = compiled if compiled is not None else training.compiles_rows_by_default(CUDA)
        assert len(compiled_calls) == (3 * 3 if resident and compiles else 0)  # three tables, three steps
        models.append(model)
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters(), strict=True):
            _assert_close(b, a, FP32_TOL)


def test_compiled_dense_updates_on_cuda_match_the_foreach_pass_and_torch_adamw(monkeypatch):
    """Dense parameters on the GPU, float32 and bf16: `RowSparseAdamW`'s default (`compiled_dense=None`, one compiled
    function per parameter on CUDA with Triton) against the foreach pass (`compiled_dense=False`) to a float32 or a
    bf16 rounding, and float32 against torch's AdamW; the compiled function counted (three parameters, four steps, one
    of them skipped by one) and its graphs (it did compile: not run eager past a recompile limit)."""
    from torch._dynamo.utils import counters

    from stem_hf import training

    if not training.compiles_rows_by_default(CUDA):
        pytest.skip("no Triton for this GPU: the default is the foreach pass")
    torch.compiler.reset()
    monkeypatch.setattr(training, "COMPILED_DENSE_MIN_ELEMENTS", 1)
    calls = []
    compiled_fn = training._compiled_adamw_dense
    monkeypatch.setattr(training, "_compiled_adamw_dense", lambda: calls.append(1) or compiled_fn())
    for dtype in (torch.float32, torch.bfloat16):
        calls.clear()
        counters.clear()
        compiled, reference, _, _ = dense_adamw_steps(None, dtype, device="cuda")
        assert len(calls) == 11 and counters["stats"]["unique_graphs"] >= 2  # a matrix's and a vector's
        eager, _, _, _ = dense_adamw_steps(False, dtype, device="cuda")
        ulp = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
        for param, expected in zip(compiled, eager, strict=True):
            assert param.device.type == "cuda" and param.dtype == dtype
            torch.testing.assert_close(param, expected, rtol=ulp, atol=1e-6)
        if dtype == torch.float32:
            for param, theirs in zip(compiled, reference, strict=True):
                torch.testing.assert_close(param, theirs, rtol=1e-5, atol=1e-6)


def test_clipping_and_the_row_update_of_resident_cuda_tables_make_no_host_sync(monkeypatch):
    """Resident tables with sparse gradients on the GPU, after the moments hold every row: `clip_grad_norm` and
    `RowSparseAdamW.step` (its default: compiled rows, and compiled dense updates, every dense parameter of this small
    model taken for a large one) run under `torch.cuda.set_sync_debug_mode("error")`, which raises at any
    synchronizing call (a value read back, a pageable copy); the forward syncs twice (the id check and its distinct
    ids), outside the mode."""
    from stem_hf import training
    from stem_hf.training import RowSparseAdamW, clip_grad_norm, param_groups, use_sparse_table_grads

    monkeypatch.setattr(training, "COMPILED_DENSE_MIN_ELEMENTS", 1)
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3], keep_tables_on_cpu=False)
    model.to(CUDA).train()
    use_sparse_table_grads(model)
    optimizer = RowSparseAdamW(param_groups(model, 1e-2, row_sparse_tables=True))
    for step in range(6):
        ids = _ids((4, 24), seed=step).to(CUDA)
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        checked = step >= 3  # by then every row has moments (vocab 96), and the compiled update has compiled
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    state = optimizer.state[model.model.stem_tables["1"].weight]
    assert state["exp_avg"].shape[0] == 96


@pytest.mark.parametrize("resident", [True, False])
def test_the_fused_lookup_is_the_cuda_default_and_gives_the_unfused_logits_tokens_and_gradients(monkeypatch, resident):
    """On CUDA `fused_table_lookup=None` fuses forwards of `FUSED_LOOKUP_MIN_TOKENS` tokens or more (inductor writes
    the Triton kernel), for resident tables and for rows moved from host memory: fp32 logits, greedy tokens and a
    train step's gradients (sparse table gradients) equal the unfused model's; a bf16 dense part's logits too, to
    bf16 rounding."""
    import stem_hf.modeling_stem as modeling

    assert modeling.fuses_lookups_on(CUDA)  # Triton comes with torch's CUDA builds
    run, fused_calls = modeling._run_compiled, []
    monkeypatch.setattr(modeling, "_run_compiled", lambda fn, *args: fused_calls.append(fn.__name__) or run(fn, *args))
    ids = _ids((4, 32), seed=4).to(CUDA)  # FUSED_LOOKUP_MIN_TOKENS: decoding steps after this prompt are unfused
    assert ids.numel() >= modeling.FUSED_LOOKUP_MIN_TOKENS
    models, outputs = [], []
    for fused in (None, False):
        torch.manual_seed(0)
        model = sensitive_model(table_dtype="float32", fused_table_lookup=fused, keep_tables_on_cpu=not resident)
        model.to(CUDA)
        assert all((t.weight.device.type == "cuda") is resident for t in model.model.stem_tables.values())
        fused_calls.clear()
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        model.train()
        for table in model.model.stem_tables.values():
            table.sparse = True
        model(ids, labels=ids).loss.backward()
        calls = set(fused_calls)
        assert calls == ({"gated_lookup", "gated_lookup_grads"} if fused is None else set()), calls
        grads = {n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in model.named_parameters()}
        outputs.append((logits, tokens, grads))
        models.append(model)
    (logits, tokens, grads), (logits_u, tokens_u, grads_u) = outputs
    _assert_close(logits, logits_u, FP32_TOL)
    assert torch.equal(tokens, tokens_u)
    for name, grad in grads_u.items():
        _assert_close(grads[name], grad, FP32_TOL)
    with torch.no_grad():
        bf16 = [m.eval().to(torch.bfloat16)(ids).logits for m in models]  # the tables stay float32
    _assert_close(bf16[0], bf16[1], BF16_TOL)


def test_continuous_batching_captures_cuda_graphs_of_resident_tables_and_refuses_host_ones(caplog):
    """`generate_batch` with CUDA graphs (what flash attention gets by default): with resident tables, the greedy
    tokens of full forwards without a cache on the GPU; with host tables, each request fails
    with the model's own error at the first capture, which names what to do, where a replay would serve the captured
    batch's rows to every later batch."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from stem_hf.remote_check import greedy_without_cache

    prompts = [_ids((1, n), seed=n)[0].tolist() for n in (5, 9, 12)]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    graphs = ContinuousBatchingConfig(use_cuda_graph=True)
    model = tiny_model(keep_tables_on_cpu=False).to(CUDA).eval()
    with torch.no_grad():
        served = model.generate_batch(prompts, generation_config=config, continuous_batching_config=graphs)
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=CUDA)
            expected = greedy_without_cache(model, ids, 6)[0, len(prompt) :].tolist()
            assert served[f"req_{i}"].generated_tokens == expected, i

    host = tiny_model().to(CUDA).eval()  # tables stay in host memory
    assert host.model.stem_tables["1"].weight.device.type == "cpu"
    with torch.no_grad(), caplog.at_level("ERROR"):
        served = host.generate_batch(prompts, generation_config=config, continuous_batching_config=graphs)
    assert all(not served.get(f"req_{i}") or not served[f"req_{i}"].generated_tokens for i in range(len(prompts)))
    assert "use_cuda_graph=False" in caplog.text
