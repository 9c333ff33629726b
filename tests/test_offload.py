"""The offload engine on CPU: the token-major store and its gather against a plain index, the row cache's hits,
misses and evictions, and identical logits and generations with offloaded and resident tables."""

import os
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stem_hf import StemForCausalLM
from stem_hf.modeling_stem import INDEX_SELECT_GRAIN, gather_rows, row_pieces
from stem_hf.offload import StemHostTables, StemOffloadedRows, StemOffloadEngine, StemRowCache, offloaded
from tests.conftest import benchmark_script, sensitive_model, tiny_model


def test_the_store_is_token_major_and_gathers_what_a_plain_index_gives():
    model = sensitive_model(table_dtype="bfloat16")
    tables = {int(k): m.weight for k, m in model.model.stem_tables.items()}
    store = StemHostTables(tables)
    assert store.data.shape == (96, 2, 64) and store.data.dtype == torch.bfloat16
    assert store.data[7, 1].data_ptr() - store.data[7, 0].data_ptr() == 64 * 2  # a token's rows are contiguous
    ids = torch.tensor([5, 0, 95, 5])
    rows, scales = store.gather(ids)
    assert scales is None
    for layer, slot in store.slot.items():
        torch.testing.assert_close(rows[:, slot], tables[layer][ids], rtol=0, atol=0)


def test_int8_store_halves_the_bytes_and_stays_close():
    model = sensitive_model(table_dtype="bfloat16")
    tables = {int(k): m.weight for k, m in model.model.stem_tables.items()}
    bf16, int8 = StemHostTables(tables), StemHostTables(tables, int8=True)
    assert int8.data.dtype == torch.int8 and int8.nbytes < 0.55 * bf16.nbytes
    ids = torch.arange(96)
    rows, scales = int8.gather(ids)
    for layer, slot in int8.slot.items():
        exact = tables[layer].float()
        approx = rows[:, slot].float() * scales[:, slot, None]
        assert (approx - exact).abs().max() <= exact.abs().amax() / 127 * 0.51


@pytest.mark.parametrize("int8", [False, True])
def test_fetches_alternate_between_two_staging_buffers_that_grow(int8):
    """The staging double-buffer, which the CPU path gathers into too: fetch N+1 never overwrites fetch N's rows (its
    forward, or its copy on a GPU, may still read them), fetch N+2 reuses fetch N's buffer, and a fetch larger than a
    buffer replaces it."""
    engine = StemOffloadEngine(sensitive_model(table_dtype="bfloat16"), int8=int8)
    expected = {}

    def fetch(ids):
        ids = torch.tensor(ids)
        rows, scales, ready = engine._fetch(ids)
        assert ready is None  # nothing to wait for without CUDA
        expected[rows.data_ptr()] = engine.store.gather(ids)
        return rows, scales

    first, first_scales = fetch([3, 9, 4])
    second, _ = fetch([50, 51])
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, expected[first.data_ptr()][0], rtol=0, atol=0)  # intact after the next fetch
    if int8:
        torch.testing.assert_close(first_scales, expected[first.data_ptr()][1], rtol=0, atol=0)
    third, _ = fetch([7])
    assert third.data_ptr() == first.data_ptr()  # the first buffer, reused
    assert [b[0].shape[0] for b in engine._staging] == [256, 256]  # the smallest buffer holds 256 tokens
    big, _ = fetch(list(range(96)) * 3)  # 288 tokens: the other buffer, not the third fetch's, grows
    assert sorted(b[0].shape[0] for b in engine._staging) == [256, 288] and big.data_ptr() != third.data_ptr()
    torch.testing.assert_close(big, expected[big.data_ptr()][0], rtol=0, atol=0)
    assert not any(b[0].is_pinned() for b in engine._staging)  # pinned only when there is a CUDA device to copy to


class _IndexSelects(TorchDispatchMode):
    """Records the row width (elements) of every `index_select` along dimension 0 made on the CPU."""

    def __init__(self):
        super().__init__()
        self.widths = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten.index_select and args[0].device.type == "cpu" and args[1] == 0:
            self.widths.append(args[0][0].numel() if args[0].dim() > 1 else 1)
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_gather_rows_gives_index_selects_rows_and_errors_at_any_width(dtype):
    assert [row_pieces(n) for n in (3, 32767, 32768, 6 * 5632, 12 * 5632, 32771)] == [1, 1, 2, 2, 3, 1]  # 32771: prime
    for shape in [(40, 3), (40, 2, 16384), (40, 12, 5632), (40, 32771)]:  # below the grain, 2 and 3 pieces, prime
        source = (torch.randn(shape) * 40).to(dtype)
        ids = torch.tensor([3, 0, 39, 3, 17])
        row = source[0].numel()
        for index in (ids, ids.int()):
            with _IndexSelects() as calls:
                rows = gather_rows(source, index)
            assert torch.equal(rows, source[ids]) and rows.shape == (5, *shape[1:])
            assert calls.widths == [row // row_pieces(row)] and (row == 32771 or max(calls.widths) < INDEX_SELECT_GRAIN)
        staging = torch.empty((8, *shape[1:]), dtype=dtype)  # the engine gathers into the front of a larger buffer
        assert gather_rows(source, ids, out=staging[:5]).data_ptr() == staging.data_ptr()
        assert torch.equal(staging[:5], source[ids])
        with _IndexSelects() as calls:  # not contiguous: index_select's own way, whole rows
            assert torch.equal(gather_rows(source[::2], ids // 2), source[::2][ids // 2])
        assert calls.widths == [row]
        for bad in (40, -1):  # a piece's index falls outside too: index_select's own error
            with pytest.raises(IndexError, match="out of range"):
                gather_rows(source, torch.tensor([1, bad]))
        for index in (torch.tensor([True, False]), torch.tensor([200, 250], dtype=torch.uint8)):  # never cast
            with pytest.raises(RuntimeError, match="Expected dtype int32 or int64"):
                gather_rows(source, index)
    if dtype.is_floating_point:  # without `out`, differentiable as index_select is
        source = torch.randn((6, 2, 16384), dtype=dtype, requires_grad=True)
        gather_rows(source, torch.tensor([4, 1, 4])).sum().backward()
        assert source.grad[4].eq(2).all() and source.grad[1].eq(1).all() and source.grad[[0, 2, 3, 5]].eq(0).all()


@pytest.mark.parametrize("int8", [False, True])
def test_the_engine_gathers_a_tokens_rows_over_every_layer_below_index_selects_grain(int8, tmp_path):
    """A token's rows over every STEM layer are one row of the store: 6 layers of d_ff 5632 at the GPU benchmark's
    0.75B shape, beyond the width torch's CPU index_select copies by one memcpy (it copies each wider row with a
    thread-pool round trip of its own). The engine gathers them in pieces below it, from a store in memory or mapped,
    and serves the same logits as the model's own tables."""
    from stem_hf.offload import write_offload_store

    model = sensitive_model(intermediate_size=INDEX_SELECT_GRAIN // 2, table_dtype="bfloat16")  # 2 layers: 32768 wide
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    stores = [{"int8": True}] if int8 else [{}]
    if not int8:
        model.save_pretrained(tmp_path / "ckpt")
        model = StemForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
        stores.append({"store": write_offload_store(tmp_path / "ckpt")})
    for options in stores:
        with offloaded(model, **options), torch.no_grad(), _IndexSelects() as calls:
            logits = model(ids).logits
        assert calls.widths and max(calls.widths) < INDEX_SELECT_GRAIN, options
        assert INDEX_SELECT_GRAIN // 2 in calls.widths  # the store's rows, in two pieces each
        if int8:
            torch.testing.assert_close(logits, expected, rtol=0.05, atol=0.05)
        else:
            torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"cache_tokens": 6}, {"int8": True}])
def test_the_engines_rows_are_gathered_inside_the_layers_kernel_where_the_config_fuses_lookups(options):
    """The engine hands each STEM layer the forward's distinct rows and each position's place among them, as the
    model's host path does, where `fused_table_lookup` says (True here; the default on CUDA): the layer's one kernel
    gathers them (`fused_gated_lookup`), with the unfused engine's logits and greedy tokens."""
    from stem_hf import modeling_stem

    model = sensitive_model(table_dtype="float32")
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    fused, original = [], modeling_stem.fused_gated_lookup
    with pytest.MonkeyPatch.context() as patch, offloaded(model, **options), torch.no_grad():
        patch.setattr(
            modeling_stem, "fused_gated_lookup", lambda gate, lookup: fused.append(lookup) or original(gate, lookup)
        )
        logits, tokens = model(ids).logits, model.generate(ids, **settings)
        assert fused == []  # the default, on the CPU: rows
        model.config.fused_table_lookup = True
        got, got_tokens = model(ids).logits, model.generate(ids, **settings)
    assert len(fused) == 2 * (1 + 4) and all(isinstance(lookup, modeling_stem.StemLookup) for lookup in fused)
    assert fused[0].table.shape == (len(ids.unique()), 64) and fused[0].index.shape == ids.shape
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-5 * logits.abs().max().item())
    assert torch.equal(got_tokens, tokens)


def test_the_cache_evicts_the_least_used_then_the_least_recent():
    cache = StemRowCache(capacity=2, vocab_size=20, layers=1, width=1, dtype=torch.float32, device="cpu", scales=False)

    def use(*ids):
        ids = torch.tensor(ids)
        slots = cache.lookup(ids)
        miss = slots < 0
        rows = ids[miss].float()[:, None, None]
        cache.insert(ids[miss], rows, None, keep=slots[~miss])
        return (~miss).tolist()

    assert use(10) == [False] and use(11) == [False]
    assert use(10) == [True]  # 10: two uses, 11: one
    use(12)  # evicts 11, the least used
    assert cache.cached() == {10, 12} and cache.slot_of[11] == -1
    assert use(12) == [True]  # 10 and 12 both at two uses; 10 was used longer ago
    use(13)
    assert cache.cached() == {12, 13}
    assert cache.rows[cache.slot_of[13], 0, 0] == 13.0
    assert (cache.hits, cache.misses) == (2, 4) and cache.hit_rate == pytest.approx(2 / 6)


def test_a_batch_larger_than_the_cache_is_served_and_keeps_its_hits():
    model = sensitive_model(table_dtype="float32")
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        expected = model(ids).logits
        with offloaded(model, cache_tokens=8) as engine:
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
            assert len(engine.cache.cached()) == 8 and engine.stats["fetched_tokens"] == 37
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    assert engine.cache.hits == 8


@pytest.mark.parametrize("cache_tokens", [0, 6, 200])
def test_offloaded_and_resident_tables_give_identical_logits_and_generations(cache_tokens):
    model = sensitive_model(table_dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in a batch
    kwargs = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    greedy = model.generate(ids, do_sample=False, **kwargs)
    torch.manual_seed(1)
    sampled = model.generate(ids, do_sample=True, top_k=20, **kwargs)
    with offloaded(model, cache_tokens=cache_tokens) as engine:
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask).logits, logits, rtol=0, atol=0)
        assert torch.equal(model.generate(ids, do_sample=False, **kwargs), greedy)
        torch.manual_seed(1)
        assert torch.equal(model.generate(ids, do_sample=True, top_k=20, **kwargs), sampled)
    assert engine.stats["forwards"] == 1 + 2 * 8  # one per prefill and per decode step
    # With the KV cache, a decode step looks up its 3 new tokens only; the prefills fetch the prompt's distinct ids.
    prompt = len(torch.unique(ids))
    assert engine.stats["fetched_tokens"] <= 3 * prompt + 2 * 7 * 3
    if cache_tokens == 200:  # the second generate and the logits pass find the prompt in the cache
        assert engine.cache.hit_rate > 0.3 and engine.stats["fetched_tokens"] < prompt + 2 * 7 * 3
    with torch.no_grad():  # detached: the model's own tables again
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, logits, rtol=0, atol=0)


def test_a_device_map_load_and_freed_tables_serve_from_the_store(tmp_path):
    model = sensitive_model(table_dtype="bfloat16")
    model.save_pretrained(tmp_path / "ckpt")
    loaded = StemForCausalLM.from_pretrained(tmp_path / "ckpt", device_map={"": "cpu"})
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        engine = StemOffloadEngine(loaded, cache_tokens=16, free_tables=True).attach()
        assert loaded.model.stem_tables["1"].weight.numel() == 0
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
        assert engine.prefetch(torch.arange(3, 30)) > 0 and engine.prefetch(torch.arange(3, 10)) == 0
        engine.detach()  # rebuilds the freed tables from the store: the model runs and saves as before
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "again")
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=0)
    int8 = StemOffloadEngine(model, int8=True, free_tables=True)
    with pytest.raises(ValueError, match="cannot be rebuilt exactly"):
        int8.detach()


def test_int8_offload_changes_logits_little_with_or_without_a_cache():
    model = sensitive_model(table_dtype="bfloat16")
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        with offloaded(model, int8=True):
            got = model(ids).logits
        with offloaded(model, int8=True, cache_tokens=10) as engine:
            cached = [model(ids).logits for _ in range(2)]  # the second pass reads rows and scales from the cache
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert not torch.equal(got, expected)
    assert engine.cache.hits > 0
    for logits in cached:
        torch.testing.assert_close(logits, got, rtol=0, atol=0)


def test_a_model_without_stem_layers_has_nothing_to_offload():
    with pytest.raises(ValueError, match="no STEM layers"):
        StemOffloadEngine(tiny_model(stem_layers=[]))
    with pytest.raises(ValueError, match="no row cache"):
        StemOffloadEngine(sensitive_model()).prefetch(torch.tensor([1]))


def test_chunked_prefill_after_a_prompt_prefetch_reads_the_cache_only():
    model = sensitive_model(table_dtype="bfloat16")
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    with offloaded(model, cache_tokens=64) as engine:
        fetched = engine.prefetch(ids)  # the prompt's ids are known before any compute
        assert fetched == len(torch.unique(ids)) and engine.stats["fetched_tokens"] == fetched
        out = model.generate(ids, max_new_tokens=6, do_sample=False, prefill_chunk_size=8)
    assert torch.equal(out, expected)
    assert engine.stats["forwards"] == 3 + 5  # three prefill chunks of at most 8 tokens, then decode
    assert engine.cache.misses <= 5  # the chunks all hit; only generated tokens can miss


@pytest.mark.parametrize("int8", [False, True])
def test_a_planned_chunked_prefill_gathers_each_next_chunk_in_the_background(int8):
    model = sensitive_model(table_dtype="bfloat16")
    ids = torch.randint(3, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    with offloaded(model, int8=int8) as reference:  # the same store, served forward by forward
        expected = model.generate(ids, max_new_tokens=5, do_sample=False, prefill_chunk_size=8)
    assert reference.stats["planned_forwards"] == 0
    with offloaded(model, int8=int8) as engine:
        engine.plan(ids, chunk_size=8)
        out = model.generate(ids, max_new_tokens=5, do_sample=False, prefill_chunk_size=8)
        assert engine.stats["planned_forwards"] == 3  # chunks of 8, 8 and 5 tokens, each gathered ahead
        assert not engine._plan and engine._ahead is None
        assert engine._worker is not None
    assert engine._worker is None  # detach stops the thread
    assert torch.equal(out, expected)
    assert engine.stats["forwards"] == 3 + 4


def test_a_forward_off_the_plan_drops_it_and_is_served_as_usual():
    model = sensitive_model(table_dtype="bfloat16")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    other = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(other).logits
        with offloaded(model) as engine:
            engine.plan(ids, chunk_size=4)
            got = model(other).logits  # not the planned first chunk
            assert not engine._plan and engine.stats["planned_forwards"] == 0
    assert torch.equal(got, expected)
    with (
        offloaded(model, cache_tokens=16) as engine,
        pytest.raises(ValueError, match="plan: the engine has a row cache"),
    ):
        engine.plan(ids, chunk_size=4)


def test_a_failed_background_gather_is_reported_and_the_forward_fetches_its_own_rows():
    model = sensitive_model(table_dtype="bfloat16")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(ids[:, :6]).logits
        with offloaded(model) as engine:
            gather = engine._gather

            def broken(*args):  # fails on the worker thread only: the forward's own fetch still works
                if threading.current_thread().name.startswith("stem-rows"):
                    raise RuntimeError("pinned memory exhausted")
                return gather(*args)

            engine._gather = broken
            engine.plan(ids, chunk_size=6)
            with pytest.warns(UserWarning, match="a background gather failed.*pinned memory exhausted"):
                got = model(ids[:, :6]).logits
            assert not engine._plan and engine._ahead is None and engine.stats["planned_forwards"] == 0
            with pytest.raises(ValueError, match="plan: the prompt is empty"):
                engine.plan(ids[:, :0], chunk_size=6)
    assert torch.equal(got, expected)


# Fault cases: stores whose save cannot be compared with the model's, and token ids outside the vocabulary -------------


def _saved_model(folder, std: float = 1.0) -> StemForCausalLM:
    sensitive_model(std, table_dtype="bfloat16").save_pretrained(folder)
    return StemForCausalLM.from_pretrained(folder).eval()


def _without_save_id(path: str, out) -> str:
    """A copy of the store at `path` whose metadata records no save id, as one written before save ids would."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from stem_hf.checkpoint_stem import SAVE_ID_KEY

    with safe_open(path, "pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != SAVE_ID_KEY}
    save_file(load_file(path), out, metadata)
    return str(out)


def test_a_store_without_a_save_id_holding_another_models_tables_is_refused_unless_allowed(tmp_path):
    from stem_hf.offload import write_offload_store

    other = _saved_model(tmp_path / "other", std=3.0)
    store = _without_save_id(write_offload_store(tmp_path / "other"), tmp_path / "old-store.safetensors")
    model = _saved_model(tmp_path / "ckpt")  # the same config, other tables: only a save id tells them apart
    ids = torch.tensor([[1, 5, 9, 33, 70, 5, 2]])
    with pytest.raises(ValueError, match=r"records no save id.*stem-hf offload-store CHECKPOINT.*allow_unverified"):
        StemOffloadEngine(model, store=store)
    with torch.no_grad(), StemOffloadEngine(model, store=store, allow_unverified=True):  # opted in: served as is
        served = model(ids).logits
        expected = other(ids).logits
    torch.testing.assert_close(served, expected, rtol=0, atol=0)


def test_a_model_without_a_save_or_changed_since_is_refused_a_store_unless_allowed(tmp_path):
    from stem_hf.editing import StemEdit, persist_edit
    from stem_hf.offload import StemMappedTables, write_offload_store

    model = _saved_model(tmp_path / "ckpt")
    store = write_offload_store(tmp_path / "ckpt")
    fresh = sensitive_model(table_dtype="bfloat16")  # the same tables, never saved: nothing vouches for them
    with pytest.raises(ValueError, match=r"the model records no save id.*allow_unverified=True"):
        StemOffloadEngine(fresh, store=store)
    with pytest.raises(ValueError, match="the model records no save id"):
        StemMappedTables(store, fresh.config)  # checked against a model, whose save id was not passed
    StemOffloadEngine(fresh, store=store, allow_unverified=True)
    persist_edit(model, StemEdit((5,), (9,)))  # its tables now differ from the checkpoint the store was written from
    with pytest.raises(ValueError, match=r"tables changed since its last load or save \(trained or edited"):
        StemOffloadEngine(model, store=store)
    with pytest.raises(ValueError, match="allow_unverified: only a mapped store"):
        StemOffloadEngine(model, allow_unverified=True)


def test_a_trained_model_saved_in_float32_takes_the_store_of_that_save(tmp_path):
    """Training leaves config.table_dtype bf16 while the save holds the float32 tables: the store written from that save
    is the model's own, and serves its logits."""
    from stem_hf.offload import write_offload_store

    model = sensitive_model(table_dtype="bfloat16").train()  # upcasts the tables to float32 in memory
    model.eval()
    model.save_pretrained(tmp_path / "ckpt")
    assert model.config.table_dtype == "bfloat16"
    store = write_offload_store(tmp_path / "ckpt")
    ids = torch.tensor([[5, 9, 5, 2]])
    with torch.no_grad():
        expected = model(ids).logits
        with StemOffloadEngine(model, store=store):
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_prefetch_and_plan_refuse_ids_outside_the_vocabulary_as_the_forward_does(bad):
    model = sensitive_model()
    ids = torch.tensor([[5, bad, 7]])
    with pytest.raises(ValueError, match=rf"input_ids holds token id {bad}, outside \[0, 96\)"):
        model(ids)
    cached = StemOffloadEngine(model, cache_tokens=8)
    with pytest.raises(ValueError, match=rf"prefetch: ids holds token id {bad}, outside \[0, 96\): vocab_size is 96"):
        cached.prefetch(ids)
    assert not cached.cache.cached() and cached.stats["fetched_tokens"] == 0  # refused before any fetch
    with pytest.raises(ValueError, match=rf"plan: ids holds token id {bad}, outside \[0, 96\)"):
        StemOffloadEngine(model).plan(ids, chunk_size=2)


def test_prefetch_and_plan_refuse_float_ids():
    model = sensitive_model()
    with pytest.raises(ValueError, match=r"prefetch: ids has dtype torch.float32: token ids must be integers"):
        StemOffloadEngine(model, cache_tokens=8).prefetch(torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match=r"plan: ids has dtype torch.float32"):
        StemOffloadEngine(model).plan(torch.tensor([[3.0, 4.0]]), chunk_size=2)
    engine = StemOffloadEngine(model, cache_tokens=8)
    assert engine.prefetch(torch.tensor([3, 4], dtype=torch.int32)) == 2  # any integer dtype is fine


def test_tables_freed_by_an_int8_engine_are_named_by_a_forward_a_save_and_a_resize(tmp_path):
    model = sensitive_model(table_dtype="bfloat16")
    engine = StemOffloadEngine(model, int8=True, free_tables=True)  # never attached, and it cannot rebuild them
    with pytest.raises(ValueError, match="cannot be rebuilt exactly"):
        engine.detach()
    freed = r"tables were freed by StemOffloadEngine\(free_tables=True\).*attach the engine, or detach it"
    with pytest.raises(RuntimeError, match=f"STEM table 1: the model's {freed}"):
        model(torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match=f"model.stem_tables.1.weight cannot be saved: the model's {freed}"):
        model.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(RuntimeError, match=f"resize_token_embeddings: the model's {freed}"):
        model.resize_token_embeddings(128)
    assert model.model.embed_tokens.num_embeddings == 96


def test_the_host_gather_benchmark_times_each_way_on_rows_it_checked_equal(monkeypatch):
    """`benchmarks/bench_host_gather.py` at a small vocabulary: the store's rows by `index_select` and by
    `gather_rows` (checked equal before any timing) and the per-layer gathers, at each thread count."""
    import argparse

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    bench = benchmark_script("bench_host_gather")
    args = argparse.Namespace(vocab=300, d_ff=5632, batch_size=2, seq_len=40, repeats=1, threads=[1, 2])
    threads = torch.get_num_threads()
    try:
        report = bench.run("1/2", args)
    finally:
        torch.set_num_threads(threads)
    assert report["row_elements"] == 6 * 5632 >= report["grain"]
    for kind in ("uniform", "zipf"):
        assert report[kind]["distinct_ids"] == len(bench.token_ids(kind, (2, 40), 300, torch.device("cpu")).unique())
        for t in (1, 2):
            timed = report[kind][f"threads_{t}"]
            ways = ("index_select", "gather_rows", "store_per_layer", "per_layer")
            assert all(timed[f"{way}_ms"] > 0 for way in ways)
            assert timed["gather_rows_over_index_select"] > 0


@pytest.mark.parametrize("store", ["memory", "int8", "mapped"])
def test_a_large_forward_fetches_its_rows_layer_by_layer_ahead_of_the_layers(store, tmp_path, monkeypatch):
    """Without a row cache, a forward of at least `pipeline_ids` distinct ids (a prefill; by default on CUDA only) is
    served layer by layer: the worker thread fetches each STEM layer's rows `HOST_ROWS_AHEAD` layers ahead of the one
    that reads them, each layer once, with the logits of the engine's one gather for every layer (and of the model's
    own tables); a smaller forward (a decoding step) takes the one gather. A layer asked twice is fetched again."""
    from stem_hf import modeling_stem
    from stem_hf.modeling_stem import HOST_ROWS_AHEAD
    from stem_hf.offload import StemPipelinedRows, write_offload_store

    model = sensitive_model(table_dtype="bfloat16", stem_layers=[0, 1, 2, 3])
    options = {"int8": True} if store == "int8" else {}
    if store == "mapped":
        model.save_pretrained(tmp_path / "ckpt")
        model = StemForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
        options = {"store": write_offload_store(tmp_path / "ckpt")}
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    distinct = len(ids.unique())
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with offloaded(model, **options) as engine, torch.no_grad():
        assert engine.pipeline_ids is None  # on the CPU the default never pipelines: nothing to overlap
        expected, tokens = model(ids).logits, model.generate(ids, **settings)
    served, original = [], StemPipelinedRows.distinct

    def distinct_then_record(rows, layer_idx):
        out = original(rows, layer_idx)
        served.append((layer_idx, sorted(rows._ahead)))
        return out

    monkeypatch.setattr(StemPipelinedRows, "distinct", distinct_then_record)
    with offloaded(model, pipeline_ids=distinct, **options) as engine, torch.no_grad():
        fetched, fetch = [], engine._fetch_layer

        def fetch_and_record(layer, unique, main):
            fetched.append((layer, len(unique)))
            return fetch(layer, unique, main)

        engine._fetch_layer = fetch_and_record
        rows = engine(ids)
        assert isinstance(rows, StemPipelinedRows) and engine.stats["fetched_tokens"] == distinct
        assert sorted(rows._ahead) == [0, 1, 2]  # started before any layer asks
        for ahead in rows._ahead.values():
            ahead.result()
        assert fetched == [(layer, distinct) for layer in range(3)]
        fetched.clear()
        logits = model(ids).logits
        assert [layer for layer, _ in served] == [0, 1, 2, 3]  # in order, each with the next ones under way
        assert [ahead for _, ahead in served] == [[1, 2], [2, 3], [3], []] and HOST_ROWS_AHEAD == 2
        assert fetched == [(layer, distinct) for layer in range(4)]  # each layer once, only the distinct ids
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        once = rows[2]
        rows._ahead[3].result()  # the layer after it, under way on the worker: done before the refetch
        torch.testing.assert_close(rows[2], once, rtol=0, atol=0)  # asked twice: fetched again
        assert fetched[-1] == (2, distinct) and fetched.count((2, distinct)) == 2  # the forward's, then the refetch
        assert isinstance(engine(ids[:, :1]), StemOffloadedRows) and not isinstance(
            engine(ids[:, :1]), StemPipelinedRows
        )
        assert torch.equal(model.generate(ids, **settings), tokens)  # the prompt pipelined, the decoding steps not
        model.config.fused_table_lookup = True  # the layers gather the pipelined rows inside their own kernel
        lookups, fuse = [], modeling_stem.fused_gated_lookup
        monkeypatch.setattr(
            modeling_stem, "fused_gated_lookup", lambda g, lookup: lookups.append(lookup) or fuse(g, lookup)
        )
        fused = model(ids).logits
        model.config.fused_table_lookup = None
        assert [lookup.table.shape[0] for lookup in lookups] == [distinct] * 4
        torch.testing.assert_close(fused, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    if store == "memory":
        resident = model(ids).logits
        torch.testing.assert_close(logits, resident, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8"])
def test_pipeline_ids_must_be_a_whole_number_of_at_least_one_without_a_row_cache(bad):
    model = sensitive_model()
    with pytest.raises(ValueError, match="pipeline_ids"):
        StemOffloadEngine(model, pipeline_ids=bad)
    with pytest.raises(ValueError, match="pipeline_ids: 8 is an option of an engine without a row cache"):
        StemOffloadEngine(model, pipeline_ids=8, cache_tokens=16)
