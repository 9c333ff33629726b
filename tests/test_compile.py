"""torch.compile, host syncs and ops: a forward with resident tables compiles whole (`fullgraph=True`) for inference and
training and matches eager; static-cache compiled greedy decoding gives eager's tokens; a decoding step makes no host
sync; token ids are checked once per user input, not once per generated token; under compile each table gather
fuses into its layer's `SiLU(gate) * rows` kernel."""

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
from collections import Counter

import pytest
import torch
from transformers import (
    CompileConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from stem_hf import StemConfig, StemForCausalLM, modeling_stem
from stem_hf.compat_stem import CACHE_ARG
from stem_hf.host_syncs import HostSyncCounter, train_step_syncs
from stem_hf.offload import StemOffloadEngine
from tests.conftest import TINY, benchmark_script, parse_benchmark_runs, sensitive_model, tiny_model


def _ids(seed: int = 0, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_fullgraph_compile_matches_eager_in_inference_and_training():
    model = sensitive_model()
    ids = _ids()
    compiled = torch.compile(model, fullgraph=True)  # any graph break raises
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    model.train()
    eager_loss = model(ids, labels=ids).loss
    eager_loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager[name], rtol=1e-4, atol=1e-5, msg=name)
    assert eager["model.stem_tables.1.weight"].abs().sum() > 0  # the tables did get gradients


@pytest.mark.slow
def test_static_cache_compiled_greedy_decoding_gives_eager_tokens():
    model = sensitive_model()
    ids = _ids(1, (2, 7))
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **settings)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **settings)
    assert torch.equal(compiled, eager)
    assert torch.equal(model.generate(ids, cache_implementation="static", **settings), eager)


def _syncs_per_forward(model, ids, steps: int = 4) -> list[int]:
    """Host syncs inside each forward of a greedy `generate` (not generate's own stopping check between forwards)."""
    counts: list[int] = []
    with HostSyncCounter() as syncs:
        syncs.active = False

        def start(*_):
            counts.append(syncs.count)
            syncs.active = True

        def end(*_):
            syncs.active = False
            counts[-1] = syncs.count - counts[-1]

        pre, post = model.register_forward_pre_hook(start), model.register_forward_hook(end)
        try:
            model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        finally:
            pre.remove()
            post.remove()
    return counts


def test_the_host_sync_counter_counts_reads_and_data_sized_outputs_and_restores_tolist():
    original = torch.Tensor.tolist
    x = torch.tensor([0.0, 2.0, 0.0, 3.0])
    with HostSyncCounter() as syncs:
        x.nonzero(), x.tolist(), bool(x.sum() > 0), x.unique(), x + 1
        syncs.active = False
        x.tolist()
        with pytest.raises(RuntimeError, match="already entered"):
            syncs.__enter__()
    assert syncs.count == 4 and syncs.by_op == {"nonzero": 1, "tolist": 1, "_local_scalar_dense": 1, "_unique2": 1}
    assert torch.Tensor.tolist is original


@pytest.mark.parametrize("fused", [None, True])
def test_a_decoding_step_makes_no_host_sync_and_no_more_than_dense(fused):
    model = sensitive_model(fused_table_lookup=fused)
    config = {k: v for k, v in TINY.items()}
    dense = LlamaForCausalLM(LlamaConfig(**config)).eval()
    ids = _ids(2, (1, 6))
    stem, llama = _syncs_per_forward(model, ids), _syncs_per_forward(dense, ids)
    assert len(stem) == len(llama) == 4  # the prefill, then 3 decoding steps
    assert stem[1:] == [0, 0, 0], stem
    assert stem == llama, (stem, llama)


def _step_python_work(model, ids: torch.Tensor) -> tuple[int, int, int]:
    """What one cached decoding step costs the thread that launches its kernels in Python: the frames an exception
    passed through (a missed `hasattr` raises and catches one), config attribute reads (a transformers config's
    `__getattribute__` is slow) and Python calls."""
    exceptions, reads, calls = Counter(), Counter(), Counter()
    read = PreTrainedConfig.__getattribute__

    def counted(config, name):
        reads["config"] += 1
        return read(config, name)

    def trace(frame, event, arg):
        (exceptions if event == "exception" else calls)[event] += 1
        return trace

    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, step = getattr(out, CACHE_ARG), out.logits[:, -1:].argmax(-1)
        PreTrainedConfig.__getattribute__ = counted
        tracer, collecting = sys.gettrace(), gc.isenabled()
        gc.disable()  # a collection's finalizers would count
        sys.settrace(trace)
        try:
            model(step, **{CACHE_ARG: cache}, use_cache=True)
        finally:
            sys.settrace(tracer)
            PreTrainedConfig.__getattribute__ = read
            if collecting:
                gc.enable()
    return exceptions["exception"], reads["config"], calls["call"]


@pytest.mark.parametrize("engine", [False, True])
def test_a_decoding_step_adds_to_its_launching_threads_python_work_per_stem_layer_only_the_lookup(engine):
    """A decoding step on a GPU waits on the thread that launches its kernels: what each STEM layer adds to that
    thread's Python work over a Llama layer of the same shape is a budget (the lookup's checks and its call), with no
    more exceptions raised and config attributes read than a Llama layer's; served by the model's tables or by the
    offload engine."""
    ids = _ids(3, (1, 6))
    work = {}
    for layers in (4, 8):
        config = {**TINY, "num_hidden_layers": layers}
        torch.manual_seed(0)
        model = StemForCausalLM(StemConfig(**config, stem_layers="full")).eval()
        with StemOffloadEngine(model, cache_tokens=64) if engine else contextlib.nullcontext():
            work["stem", layers] = _step_python_work(model, ids)
        work["llama", layers] = _step_python_work(LlamaForCausalLM(LlamaConfig(**config)).eval(), ids)
    more = [
        [(stem - llama) for stem, llama in zip(work["stem", layers], work["llama", layers], strict=True)]
        for layers in (4, 8)
    ]
    exceptions, reads, calls = ((deep - shallow) / 4 for shallow, deep in zip(*more, strict=True))
    assert more[0][0] <= 0 and exceptions <= 0, work
    assert reads <= 0, work
    assert calls <= 20, work  # per STEM layer: the lookup's checks and its call


def _syncs_per_train_step(model, batches: list[torch.Tensor], optimizer) -> tuple[list[int], Counter]:
    """Host syncs in each train step (`train_step_syncs`: as StemTrainer steps, the backward not counted), and by
    operation over all steps."""
    steps = [train_step_syncs(model, ids, optimizer) for ids in batches]
    return [s.count for s in steps], sum((s.by_op for s in steps), Counter())


@pytest.mark.parametrize(("vocab_size", "fused"), [(96, None), (4096, None), (4096, True)])
def test_a_train_step_with_tables_on_an_accelerator_syncs_per_forward_not_per_table(monkeypatch, vocab_size, fused):
    """Resident tables with sparse gradients and clipping (StemTrainer's defaults), three of them: a step syncs as
    often as dense's plus twice, for the forward's id check (dense Llama has none) and its distinct ids; the gradients
    are taken as they come (no coalesce, no check of their rows) and the row update reads nothing back, but the count
    of rows with moments when they may have to grow, a few steps apart (a vocabulary larger than the moments). CPU
    tables stand in for an accelerator's."""
    from stem_hf import training
    from stem_hf.training import RowSparseAdamW, param_groups, use_sparse_table_grads

    monkeypatch.setattr(training, "_in_host_memory", lambda param: False)
    monkeypatch.setattr(training, "compiles_rows_by_default", lambda device: False)
    batches = [_ids(seed % 3, (2, 24)).clamp(max=vocab_size - 1) for seed in range(12)]  # the same rows come back
    model = sensitive_model(table_dtype="float32", stem_layers=[1, 2, 3], vocab_size=vocab_size)
    model.config.fused_table_lookup = fused  # True: the fused lookup, its sparse gradient over the same distinct ids
    model.train()
    use_sparse_table_grads(model)
    optimizer = RowSparseAdamW(param_groups(model, 1e-2, row_sparse_tables=True))
    stem, ops = _syncs_per_train_step(model, batches, optimizer)
    dense = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": vocab_size})).train()
    llama, _ = _syncs_per_train_step(dense, batches, RowSparseAdamW(param_groups(dense, 1e-2)))
    assert not ops["_coalesce"] and not ops["nonzero"], ops
    state = optimizer.state[model.model.stem_tables["1"].weight]
    growth = [count - llama[0] - 2 for count in stem]
    assert set(llama) == {llama[0]}, llama
    assert min(growth) == 0 and max(growth) <= 3, stem  # at most the three tables' counts, in a step that reads them
    if vocab_size == 96:
        assert state["exp_avg"].shape[0] == vocab_size and growth[-6:] == [0] * 6, stem  # moments for every row
    else:
        assert state["exp_avg"].shape[0] < vocab_size and sum(growth) <= 3 * (1 + 12 // 3), stem


def test_ids_are_checked_once_per_user_input_and_a_bad_prompt_is_still_refused(monkeypatch):
    model = sensitive_model()
    calls = []
    original = modeling_stem.check_token_ids
    monkeypatch.setattr(
        modeling_stem, "check_token_ids", lambda ids, v, name: calls.append(name) or original(ids, v, name)
    )
    ids = _ids(3, (1, 5))
    model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert calls == ["input_ids", "generate's pad_token_id"]  # once each; none for the 6 tokens generated
    calls.clear()
    model.generate(ids, stem_input_ids=ids.flip(1), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert calls == ["input_ids", "stem_input_ids", "generate's pad_token_id"]
    with torch.no_grad():
        model(ids)
    assert calls[-1] == "input_ids"  # a plain forward still checks its input
    bad = ids.clone()
    bad[0, 2] = TINY["vocab_size"]
    with pytest.raises(ValueError, match=f"input_ids holds token id {TINY['vocab_size']}, outside"):
        model.generate(bad, max_new_tokens=2)
    with pytest.raises(ValueError, match="stem_input_ids holds token id -1"):
        model.generate(ids, stem_input_ids=ids * 0 - 1, max_new_tokens=2)


def test_an_out_of_range_pad_id_that_generate_would_feed_back_is_refused():
    model = sensitive_model()
    ids = _ids(5, (2, 4))
    eos = int(ids[0, -1])  # the first row stops at once, and is padded with the pad id after that
    with pytest.raises(ValueError, match="generate's pad_token_id holds token id 200, outside"):
        model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=eos, pad_token_id=200)
    with pytest.raises(ValueError, match="generate's eos_token_id holds token id 300"):  # no pad: eos is fed back
        model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=[300, eos], pad_token_id=None)


class _Raise(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("stopped from inside generate")


class _Barrier(StoppingCriteria):
    """Holds each decoding step until the other thread's generate has reached one too."""

    def __init__(self, barrier):
        self.barrier = barrier

    def __call__(self, input_ids, scores, **kwargs):
        self.barrier.wait(timeout=30)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_forwards_check_ids_again_after_generate_raises_inside_and_in_other_threads_meanwhile():
    model = sensitive_model()
    bad = torch.tensor([[1, TINY["vocab_size"]]])
    with pytest.raises(RuntimeError, match="stopped from inside generate"):
        model.generate(_ids(6, (1, 4)), max_new_tokens=3, stopping_criteria=StoppingCriteriaList([_Raise()]))
    with pytest.raises(ValueError, match="outside"):
        model(bad)
    # Two generates in two threads overlap step by step (exits not nested), and a third thread's forward meanwhile.
    barrier, errors = threading.Barrier(3), []

    def generate():
        criteria = StoppingCriteriaList([_Barrier(barrier)])
        model.generate(_ids(7, (1, 4)), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
                       stopping_criteria=criteria)  # fmt: skip

    def forward():
        for _ in range(3):
            barrier.wait(timeout=30)
            try:
                model(bad)
            except ValueError:
                errors.append("checked")

    threads = [threading.Thread(target=generate), threading.Thread(target=generate), threading.Thread(target=forward)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == ["checked"] * 3  # another thread's generate never turned this thread's check off
    with pytest.raises(ValueError, match="outside"):
        model(bad)


# The ops that compute, gather, copy or cast (views and allocations follow from these).
_COMPUTE_OPS = tuple(
    f"aten::{op}"
    for op in ("embedding", "index_select", "index", "gather", "index_put_", "index_add_", "scatter", "linear", "mm",
               "bmm", "mul", "add", "silu", "where", "constant_pad_nd", "_to_copy", "copy_", "clone", "cat", "stack")
)  # fmt: skip


def _op_counts(model, ids) -> Counter:
    """aten ops of one forward, the token-id check (once per user input, not part of the layers) left out."""
    with torch.no_grad(), model.model.ids_checked():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(ids)
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::"))


@pytest.mark.parametrize(
    ("model_dtype", "table_dtype"), [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]
)
def test_a_stem_forward_is_a_dense_one_with_each_up_projection_replaced_by_one_gather(model_dtype, table_dtype):
    """Against the same model with no STEM layer (Llama's layers: attention, rotary and norms vary with the installed
    transformers), op by op: each STEM layer drops one matrix product and adds one row gather, and nothing else; rows
    are cast (one copy of the [tokens, d_ff] rows, never of a table) only where the tables are stored in another dtype
    than the model computes in."""
    model = sensitive_model(table_dtype=table_dtype).to(getattr(torch, model_dtype))
    dense = sensitive_model(stem_layers=[]).to(getattr(torch, model_dtype))
    ids = _ids(4)
    stem = _op_counts(model, ids)
    n = len(model.config.stem_layers)
    expected = {"aten::embedding": n, "aten::index_select": n, "aten::linear": -n, "aten::mm": -n}
    if table_dtype != model_dtype:
        expected.update({"aten::_to_copy": n, "aten::copy_": n})
    dense_ops = _op_counts(dense, ids)
    diff = {op: stem[op] - dense_ops[op] for op in _COMPUTE_OPS if stem[op] != dense_ops[op]}
    assert diff == expected


def _inductor_calls(model, ids) -> tuple[list[str], int]:
    """The fused kernels inductor's code for one compiled inference forward calls, in order, and its matrix products."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(lambda m, x: m(x).logits, fullgraph=True)
    with torch.no_grad(), model.model.ids_checked():
        _, codes = run_and_get_code(compiled, model, ids)
    code = "\n".join(codes)
    return re.findall(r"^\s+(cpp_fused_\w+)\(", code, re.M), code.count("extern_kernels.mm(")


@pytest.mark.slow
def test_under_compile_each_gather_fuses_into_its_layers_silu_times_rows_kernel():
    """Inductor's code for a STEM forward calls as many fused kernels as the same model without STEM layers, one
    matrix product fewer per STEM layer, and each STEM layer's `SiLU(gate) * rows` kernel does the table gather
    itself: no kernel of its own, no copy of the rows."""
    model = sensitive_model(table_dtype="float32")
    dense = sensitive_model(table_dtype="float32", stem_layers=[])
    stem_kernels, stem_mm = _inductor_calls(model, _ids())
    dense_kernels, dense_mm = _inductor_calls(dense, _ids())
    silu = [k for k in stem_kernels if "silu" in k]
    assert len(silu) == model.config.num_hidden_layers
    assert sum("embedding" in k for k in silu) == len(model.config.stem_layers)  # the gather inside the kernel
    assert len(stem_kernels) == len(dense_kernels) and stem_mm == dense_mm - len(model.config.stem_layers)


def _lookups(model, ids, grad: bool = False) -> list:
    """What each STEM layer of `model` would be handed for `ids`: rows, or a `StemLookup` to gather itself."""
    with torch.set_grad_enabled(grad):
        rows = model.model.stem_tables(ids)
        return [rows.lookup(layer) for layer in model.config.stem_layers]


class _RecordingMLP(torch.nn.Module):
    """An MLP put in a STEM layer's place (as healing's blend is): records what it is handed, then runs the one it
    replaced."""

    def __init__(self, inner, seen: list):
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, x, rows):
        self.seen.append((type(self).__name__, type(rows).__name__))
        return self.inner(x, rows)


def test_lookups_fuse_for_plain_tables_and_mlps_as_the_config_says(monkeypatch):
    """`fused_table_lookup`: None (the default) fuses on CUDA with Triton for forwards of `FUSED_LOOKUP_MIN_TOKENS`
    tokens or more, True anywhere, False never; under autograd with the distinct ids a sparse table gradient needs;
    not for a hooked table, and a hooked or replaced MLP is handed rows. A layer whose activation is not SiLU gathers
    a lookup's rows itself, with the unfused logits and gradients."""
    model, ids = sensitive_model(table_dtype="float32"), _ids(5)
    assert not modeling_stem.fuses_lookups_on(torch.device("cpu")) and model.config.fused_table_lookup is None
    assert all(isinstance(r, torch.Tensor) for r in _lookups(model, ids))  # the default, on the CPU
    model.config.fused_table_lookup = True
    lookups = _lookups(model, ids)
    assert all(isinstance(r, modeling_stem.StemLookup) for r in lookups)
    table = model.model.stem_tables[str(model.config.stem_layers[0])].weight
    assert lookups[0].table is table and lookups[0].index is ids  # the table itself: nothing gathered, nothing copied
    assert lookups[0].unique is None
    training = _lookups(model, ids, grad=True)  # dense table gradients: the table and the ids
    assert all(isinstance(r, modeling_stem.StemLookup) and r.unique is None for r in training)
    for t in model.model.stem_tables.values():
        t.sparse = True
    sparse = _lookups(model, ids, grad=True)[0]  # sparse ones: over the forward's distinct ids, as unfused
    assert torch.equal(sparse.unique, ids.unique()) and torch.equal(sparse.unique[sparse.inverse], ids)
    assert _lookups(model, ids)[0].unique is None  # without autograd, no distinct ids are needed
    hook = model.model.stem_tables[str(model.config.stem_layers[0])].register_forward_hook(lambda *args: None)
    assert isinstance(_lookups(model, ids)[0], torch.Tensor) and isinstance(_lookups(model, ids)[1], type(lookups[1]))
    hook.remove()
    model.config.fused_table_lookup = None  # where the default fuses: forwards of FUSED_LOOKUP_MIN_TOKENS tokens on
    monkeypatch.setattr(modeling_stem, "fuses_lookups_on", lambda device: True)
    long = _ids(5, (2, modeling_stem.FUSED_LOOKUP_MIN_TOKENS // 2))
    assert isinstance(_lookups(model, long)[0], modeling_stem.StemLookup)
    assert isinstance(_lookups(model, long[:, :-1])[0], torch.Tensor)  # one token fewer: unfused (a decoding step)
    monkeypatch.undo()
    model.config.fused_table_lookup = True
    seen = []  # what the MLPs are handed in a forward: a hooked MLP and a replaced one want rows
    record = lambda module, args: seen.append((type(module).__name__, type(args[1]).__name__))  # noqa: E731
    hook = model.model.layers[1].mlp.register_forward_pre_hook(record)
    model.model.layers[3].mlp = _RecordingMLP(model.model.layers[3].mlp, seen)
    with torch.no_grad():
        model(ids)
    assert seen == [("StemTableMLP", "Tensor"), ("_RecordingMLP", "Tensor")], seen
    hook.remove()
    model.model.layers[3].mlp = model.model.layers[3].mlp.inner
    model.config.fused_table_lookup = False
    assert all(isinstance(r, torch.Tensor) for r in _lookups(model, ids))
    for bad in ("no", 1, 0):
        with pytest.raises(ValueError, match="fused_table_lookup"):
            tiny_model(fused_table_lookup=bad)
    gelu = sensitive_model(hidden_act="gelu", table_dtype="float32")
    compiled = []
    monkeypatch.setattr(modeling_stem, "fused_gated_lookup", lambda *args: compiled.append(args))
    grads = []
    for fused in (False, True):  # SiLU is what the fused kernel computes: a GELU layer gathers and goes on unfused
        gelu.config.fused_table_lookup = fused
        assert isinstance(_lookups(gelu, ids)[0], modeling_stem.StemLookup) is fused
        with torch.no_grad():
            grads.append([gelu(ids).logits])
        gelu.zero_grad(set_to_none=True)
        gelu(ids, labels=ids).loss.backward()
        grads[-1] += [p.grad for p in gelu.parameters()]
    assert compiled == []
    for unfused, fused in zip(*grads, strict=True):
        torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("model_dtype", "table_dtype"), [("float32", "float32"), ("bfloat16", "float32")])
def test_a_fused_lookup_is_one_kernel_with_the_gather_inside_and_gives_the_unfused_logits(
    monkeypatch, model_dtype, table_dtype
):
    """With `fused_table_lookup=True` a STEM layer outside autograd computes `SiLU(gate) * table[ids]` by one kernel
    that inductor writes with the gather inside (here C++ on the CPU; Triton on CUDA, where it is the default): no
    kernel of its own for the gather, the activation or the product. Logits equal the unfused model's to rounding, for
    resident tables and for rows moved from host memory (the host path, here on the CPU), and greedy tokens too."""
    import re

    from torch._inductor.utils import run_and_get_code

    dtype = getattr(torch, model_dtype)
    unfused = sensitive_model(table_dtype=table_dtype).to(dtype)
    fused = sensitive_model(table_dtype=table_dtype, fused_table_lookup=True).to(dtype)
    ids, tol = _ids(6), (1e-6 if dtype == torch.float32 else 2e-2)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = unfused(ids).logits
        got, codes = run_and_get_code(lambda: fused(ids).logits)
        code = "\n".join(codes)
        body = code[code.index("def call(") : code.index("return (", code.index("def call("))]
        kernels = re.findall(r"^\s+(cpp_fused_\w+)\(", body, re.M)
        assert len(kernels) == 1 and all(op in kernels[0] for op in ("embedding", "silu", "mul")), kernels
        # Nothing else runs, and the one buffer is the product: no gather, copy or cast of rows of their own.
        assert "extern_kernels." not in body and "aten." not in body and body.count("empty_strided") == 1, body
        torch.testing.assert_close(got, expected, rtol=0, atol=tol * expected.abs().max().item())
        monkeypatch.setattr(modeling_stem.StemTableRows, "host_served", lambda self, table: True)
        lookup = _lookups(fused, ids)[0]
        assert isinstance(lookup, modeling_stem.StemLookup) and lookup.table.shape[0] == len(ids.unique())
        torch.testing.assert_close(fused(ids).logits, expected, rtol=0, atol=tol * expected.abs().max().item())
        monkeypatch.undo()
    if dtype == torch.float32:
        settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(fused.generate(ids, **settings), unfused.generate(ids, **settings))


def test_the_fused_lookup_compiles_once_per_width_for_every_token_count_with_the_width_a_constant():
    """Only the token (and row) axis is symbolic: for each width, one compile of the forward and one of the gradients
    serve every token count, and d_ff is a constant of the kernel, also after another width (with a symbolic width
    the GPU kernel could not vectorize its row loads: `bench_lookup_kernel.py`). The outputs equal eager's."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    generator = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    # A width made symbolic by a second one would serve the third without a compile of its own.
    for i, (width, tokens) in enumerate([(96, 130), (96, 257), (80, 130), (80, 1000), (64, 200), (96, 1000)]):
        table = torch.nn.Parameter(torch.randn(50, width, generator=generator))
        gate = torch.randn(tokens, width, generator=generator, requires_grad=True)
        index = torch.randint(0, 50, (tokens,), generator=generator)
        lookup = modeling_stem.StemLookup(table, index)
        if i == 0:  # the first kernel's code (`run_and_get_code` starts from a reset: only here)
            out, codes = run_and_get_code(modeling_stem.fused_gated_lookup, gate, lookup)
            code = "\n".join(codes)
            assert f"{width}L" in code and "embedding" in code, code
        else:
            out = modeling_stem.fused_gated_lookup(gate, lookup)
        expected = modeling_stem.gated_lookup(gate, table, index)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        grads = torch.autograd.grad(out.square().sum(), (gate, table))
        torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (gate, table)))
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])  # per width, the forward and gradients


def _saved_rows_sized(model, ids) -> tuple[torch.Tensor, int]:
    """A training forward's loss, and how many `[tokens, d_ff]`-sized tensors autograd saves for its backward."""
    size, saved = ids.numel() * model.config.intermediate_size, []

    def pack(tensor):
        saved.append(tensor.numel() == size)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(ids, labels=ids).loss
    return loss, sum(saved)


@pytest.mark.slow
def test_a_fused_lookup_inductor_cannot_build_runs_eager_with_a_warning(monkeypatch, caplog):
    """A machine where inductor cannot build the kernel (here: no working C++ compiler) gets the unfused numbers and
    a warning, not an error; a torch dispatch mode (which dynamo cannot compile under) runs the function eager."""
    import logging

    import torch._inductor.config as inductor_config
    from torch.utils.flop_counter import FlopCounterMode

    model, ids = sensitive_model(table_dtype="float32", fused_table_lookup=True), _ids(8)
    with torch.no_grad():
        expected = sensitive_model(table_dtype="float32")(ids).logits
        with FlopCounterMode(display=False) as flops:
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-6)
        assert flops.get_total_flops() > 0
        monkeypatch.setattr(modeling_stem, "_COMPILED", {})
        torch._dynamo.reset()
        with caplog.at_level(logging.WARNING), inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-6)
    assert modeling_stem._COMPILED[modeling_stem.gated_lookup, "cpu"] is modeling_stem.gated_lookup
    assert "inductor cannot compile gated_lookup for cpu" in caplog.text


class _OutOfResources(Exception):
    """What Triton raises at a kernel's launch when the GPU lacks what it needs (`triton.runtime.errors`)."""


_OutOfResources.__module__ = "triton.runtime.errors"


@pytest.mark.parametrize(
    "error", [_OutOfResources("shared memory"), RuntimeError("Triton Error [CUDA]: invalid argument")], ids=repr
)
def test_a_fused_lookup_whose_kernel_triton_cannot_launch_runs_eager_with_a_warning(monkeypatch, caplog, error):
    """A GPU on which Triton builds the fused kernel but cannot launch it (stood in for here: the compiled function
    raises Triton's error, as no GPU is at hand) gets the unfused logits and gradients and a warning, from then on; an
    error that is not Triton's is raised."""
    import logging

    model, ids = sensitive_model(table_dtype="float32", fused_table_lookup=True), _ids(8)
    reference = sensitive_model(table_dtype="float32")
    with torch.no_grad():
        expected = reference(ids).logits

    def fails(*args):
        raise error

    kernels = (modeling_stem.gated_lookup, modeling_stem.gated_lookup_grads)
    monkeypatch.setattr(modeling_stem, "_COMPILED", {(kernel, "cpu"): fails for kernel in kernels})
    with caplog.at_level(logging.WARNING):
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-6)
        model(ids, labels=ids).loss.backward()  # the backward's kernel too
    reference(ids, labels=ids).loss.backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    assert modeling_stem._COMPILED[modeling_stem.gated_lookup, "cpu"] is modeling_stem.gated_lookup
    assert modeling_stem._COMPILED[modeling_stem.gated_lookup_grads, "cpu"] is modeling_stem.gated_lookup_grads
    assert "Triton cannot launch the kernel of gated_lookup for cpu" in caplog.text

    def other(*args):
        raise ValueError("not Triton's")

    monkeypatch.setattr(modeling_stem, "_COMPILED", {(modeling_stem.gated_lookup, "cpu"): other})
    with torch.no_grad(), pytest.raises(ValueError, match="not Triton's"):
        model(ids)


@pytest.mark.slow
def test_the_fused_lookups_backward_is_one_kernel_giving_autograds_gradients():
    """`gated_lookup_grads` compiled: one kernel writes both gradients (the gate's, each position's row's), which are
    autograd's of the plain expression (computed in float64 as the reference)."""
    import re

    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    grad, gate, table = (torch.randn(shape, generator=g) for shape in ((2, 5, 16), (2, 5, 16), (9, 16)))
    index = torch.randint(0, 9, (2, 5), generator=g)
    torch._dynamo.reset()
    (grad_gate, grad_rows), codes = run_and_get_code(
        modeling_stem._compiled(modeling_stem.gated_lookup_grads, "cpu"), grad, gate, table, index
    )
    code = "\n".join(codes)
    body = code[code.index("def call(") : code.index("return (", code.index("def call("))]
    assert len(re.findall(r"^\s+(cpp_fused_\w+)\(", body, re.M)) == 1 and body.count("empty_strided") == 2, body
    gate64, rows64 = gate.double().requires_grad_(), table.double()[index].requires_grad_()
    (torch.nn.functional.silu(gate64) * rows64).backward(grad.double())
    torch.testing.assert_close(grad_gate, gate64.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_rows, rows64.grad.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("tables", ["dense_grads", "sparse_grads", "host", "frozen", "sparse_grads_bf16_autocast"])
def test_a_fused_lookup_trains_as_the_unfused_one_and_saves_less_for_the_backward(monkeypatch, tables):
    """Under autograd the fused lookup (`StemGatedLookup`: forward and backward each one compiled kernel) gives the
    unfused loss and gradients, for resident tables with dense and with sparse gradients (over the forward's distinct
    rows, as unfused, the weight keeping their indices), rows moved from host memory (here on the CPU) and frozen
    tables, and under bf16 autocast (Trainer's `bf16=True`: the gate in bf16, the tables' gradients in float32, equal
    to bf16 rounding); and autograd keeps fewer `[tokens, d_ff]` tensors per STEM layer for the backward (`gate`
    only)."""
    if tables == "host":
        monkeypatch.setattr(modeling_stem.StemTableRows, "host_served", lambda self, table: True)
    models = [sensitive_model(table_dtype="float32", fused_table_lookup=fused).train() for fused in (False, True)]
    ids = _ids(7)
    grads, saved = [], []
    for model in models:
        for table in model.model.stem_tables.values():
            table.sparse = tables.startswith("sparse_grads")
            table.weight.requires_grad_(tables != "frozen")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tables.endswith("autocast")):
            loss, count = _saved_rows_sized(model, ids)
        loss.backward()
        saved.append(count)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        grads[-1]["loss"] = loss.detach()
    unfused, fused = grads
    assert unfused.keys() == fused.keys() and ("model.stem_tables.1.weight" in fused) is (tables != "frozen")
    for name, grad in unfused.items():
        got = fused[name]
        assert got.is_sparse is grad.is_sparse, name
        got, grad = (got.to_dense(), grad.to_dense()) if grad.is_sparse else (got, grad)
        assert got.dtype == grad.dtype, name
        if tables.endswith("autocast"):  # the fused kernel rounds to bf16 once, the unfused path at each operation
            torch.testing.assert_close(got, grad, rtol=0, atol=2e-2 * grad.abs().max().item(), msg=name)
        else:
            torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6, msg=name)
    if tables == "dense_grads":  # a second derivative (create_graph): the fused backward's every term, as eager
        g = torch.Generator().manual_seed(1)
        table = torch.nn.Parameter(torch.randn(9, 16, generator=g))
        index, seconds = torch.randint(0, 9, (2, 5), generator=g), []
        for fused in (False, True):
            gate = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
            plain = modeling_stem.gated_lookup
            out = modeling_stem.fused_gated_lookup(gate, modeling_stem.StemLookup(table, index)) if fused else None
            out = plain(gate, table, index) if out is None else out
            first = torch.autograd.grad(out.square().sum(), (gate, table), create_graph=True)
            seconds.append(torch.autograd.grad(sum(f.square().sum() for f in first), (gate, table)))
        for got, expected in zip(seconds[1], seconds[0], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        loss = models[1](ids, labels=ids).loss  # the table, kept unsaved, is still checked for in-place writes
        with torch.no_grad():
            models[1].model.stem_tables["1"].weight.add_(1.0)
        with pytest.raises(RuntimeError, match="modified in place"):
            loss.backward()
    if tables.startswith("sparse_grads"):
        for table in models[1].model.stem_tables.values():
            assert table.weight.grad._indices().data_ptr() == table.weight.stem_grad_rows.data_ptr()
    # Unfused, the product keeps SiLU(gate) for the rows' gradient (none for frozen tables) and the rows for the gate's.
    per_layer = 1 if tables == "frozen" else 2
    assert saved[0] - saved[1] == per_layer * len(models[0].config.stem_layers), saved


@pytest.mark.slow
def test_the_gpu_benchmark_runs_every_part_on_cpu_and_puts_each_ratio_beside_its_prediction(tmp_path):
    """`benchmarks/bench_gpu.py` end to end at a tiny shape on the CPU (host and engine cases need an accelerator):
    the JSON it saves holds every part, each speedup next to the FLOP-predicted one, compiled decoding's tokens."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench_gpu.json"
    command = [sys.executable, os.path.join(root, "benchmarks/bench_gpu.py"), "--device", "cpu", "--shape", "tiny",
               "--batch-size", "2", "--seq-len", "16", "--repeats", "1", "--decode-batches", "1,2", "--prompt-len",
               "8", "--new-tokens", "3", "--compile", "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and report["device"] == "cpu"
    for spec in ("1/3", "1/2", "full"):
        row = report["prefill"][spec]
        assert row["predicted_speedup"] > 1 and {"uniform", "zipf", "compiled"} <= row.keys()
        assert row["uniform"]["speedup"] > 0 and row["compiled"]["speedup"] > 0
        for kind in ("uniform", "zipf", "compiled"):  # dense timed in turn with each STEM model: the ratio's own
            stem_ms = row[kind].get("resident_ms", row[kind].get("ms"))
            assert row[kind]["speedup"] == pytest.approx(row[kind]["dense_ms"] / stem_ms, rel=1e-2, abs=2e-3)
        for kind in ("uniform", "zipf"):  # on the CPU the default does not fuse: the fused lookup is the other
            timed = row[kind]
            assert timed["fused_lookup"] is False and report["prefill"]["fused_lookup_by_default"] is False
            expected = timed["resident_ms"] / timed["other_lookup_ms"]
            assert timed["fused_over_unfused"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
    assert report["train"]["dense_compiled_adamw_ms"] > 0 and report["train"]["dense_compiled_row_sparse_adamw_ms"] > 0
    foreach = report["train"]["dense_row_sparse_adamw_foreach_ms"]  # with --compile: the dense update compiled, and not
    for spec in ("1/2", "full"):
        row = report["train"][spec]
        assert row["predicted_speedup"] > 1 and row["adamw"]["ms"] > 0 and row["row_sparse_adamw"]["ms"] > 0
        expected = foreach / row["row_sparse_adamw"]["ms"]  # every update eager, against dense's foreach pass
        assert row["row_sparse_adamw"]["speedup"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        compiled = row["compiled_adamw"]
        expected = report["train"]["dense_compiled_adamw_ms"] / compiled["ms"]
        assert compiled["speedup"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        rows = row["row_sparse_adamw_compiled_rows"]
        expected = report["train"]["dense_row_sparse_adamw_ms"] / rows["ms"]
        assert rows["speedup"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        expected = report["train"]["dense_adamw_ms"] / rows["ms"]
        assert rows["vs_dense_adamw"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        assert rows["fused_lookup"] is False and rows["fused_over_unfused"] == pytest.approx(
            rows["ms"] / rows["other_lookup_ms"], rel=1e-2, abs=2e-3
        )  # the CPU's default does not fuse; the fused lookup trained the same step
        compiled = row["compiled_row_sparse_adamw"]  # sparse table gradients, the model compiled
        expected = report["train"]["dense_compiled_row_sparse_adamw_ms"] / compiled["ms"]
        assert compiled["speedup"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        expected = report["train"]["dense_compiled_adamw_ms"] / compiled["ms"]
        assert compiled["vs_dense_compiled_adamw"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        assert compiled["vs_eager"] == pytest.approx(rows["ms"] / compiled["ms"], rel=1e-2, abs=2e-3)
        assert compiled["graphs"] > 0  # compiled indeed: dynamo made graphs
    for batch in ("batch_1", "batch_2"):
        assert report["decode"][batch]["static_compiled"]["same_tokens_as_resident"] is True
        assert report["decode"][batch]["dense_same_tokens_across_runs"] is True  # a CPU's kernels: repeatable
        assert report["decode"][batch]["resident"]["same_tokens_across_runs"] is True
        assert report["decode"][batch]["resident"]["logits_max_diff_vs_resident"] == 0  # the same forward twice
        assert report["decode"][batch]["resident_logits_std"] > 0
        row = report["decode"][batch]
        for name in ("resident", "resident_fused"):  # timed in turn with dense: each ratio from the same rounds
            expected = row["dense_step_ms"] / row[name]["step_ms"]
            assert row[name]["speedup"] == pytest.approx(expected, rel=1e-2, abs=2e-3)
        static = row["static_compiled"]  # against dense compiled the same way
        assert static["speedup"] == pytest.approx(static["dense_step_ms"] / static["step_ms"], rel=1e-2, abs=2e-3)
        fused = report["decode"][batch]["resident_fused"]  # bf16: the fused kernel rounds once, not twice
        assert (
            fused["step_ms"] > 0
            and fused["logits_max_diff_vs_resident"] < report["decode"][batch]["resident_logits_std"]
        )


def test_paired_decode_runs_the_variants_in_turn_round_by_round():
    """`bench_gpu.paired_decode`: one warm-up run of each variant, then each round runs them in turn, in reverse order
    every other round; each variant's median comes from its own timed rounds, and whether its runs repeated tokens."""
    bench = benchmark_script("bench_gpu")
    calls, times = [], {"a": iter([9.0, 1.0, 2.0, 3.0]), "b": iter([9.0, 5.0, 7.0, 6.0])}
    tokens = {"a": iter([torch.ones(2)] * 4), "b": iter([torch.ones(2)] * 3 + [torch.zeros(2)])}

    def variant(name: str):
        def run(prompt: torch.Tensor) -> tuple:
            calls.append(name)
            return next(times[name]), next(tokens[name])

        return run

    result = bench.paired_decode({"a": variant("a"), "b": variant("b")}, torch.zeros(1), repeats=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert result["a"][0] == 2.0 and result["b"][0] == 6.0  # the warm-ups' 9.0 left out
    assert result["a"][2] is True and result["b"][2] is False and torch.equal(result["b"][1], torch.zeros(2))


@pytest.mark.slow
def test_the_lookup_kernel_benchmark_runs_on_cpu_and_every_way_agrees_with_the_reference(tmp_path):
    """`benchmarks/bench_lookup_kernel.py` at a tiny shape on the CPU: every compile mode's forward equals the unfused
    one to bf16 rounding, and every way of summing the table's gradient equals a float64 sum to its dtype's rounding."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "kernel.json"
    command = [sys.executable, os.path.join(root, "benchmarks/bench_lookup_kernel.py"), "--device", "cpu",
               "--tokens", "200,300", "--d-ff", "64", "--vocab", "150", "--rounds", "1", "--inner", "1",
               "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    expected = [(dtype, tokens) for dtype in ("bfloat16", "float32") for tokens in (200, 300)]
    assert [(case["table_dtype"], case["tokens"]) for case in cases] == expected
    for case in cases:
        for mode in ("dynamic", "token_axis", "static"):
            assert case[f"forward_{mode}_max_diff"] <= 0.25 and case[f"forward_{mode}"]["ms"] > 0  # bf16 rounding
            assert case[f"backward_{mode}"]["ms"] > 0
        tolerance = 0.25 if case["table_dtype"] == "bfloat16" else 1e-4  # sums of a few terms of size about 1
        for way in ("embedding_backward", "index_add", "segment_reduce", "fused_atomic"):
            assert case[f"table_grad_{way}_max_diff"] < tolerance and case[f"table_grad_{way}"]["ms"] > 0, way
        assert case["table_grad_embedding_backward_repeatable"] and case["table_grad_segment_reduce_repeatable"]
        assert case["fused_atomic_adds"] is True  # inductor's code sums the rows by atomic adds
        assert 0 < case["distinct_rows"] <= 150


def test_the_gpu_benchmarks_refuse_a_bad_list_of_sizes_before_any_work(tmp_path):
    """`--tokens` and `--decode-batches` take whole numbers of at least 1, comma-separated (`cli_args.positive_ints`),
    `--specs` and `--skip` STEM ratios and parts the benchmark knows; anything else is refused by argparse, naming the
    option, and nothing is written."""
    from stem_hf.cli_args import positive_ints

    assert positive_ints("1,16,64") == [1, 16, 64]
    bench = benchmark_script("bench_gpu")
    assert bench.specs("full,1/2") == ["full", "1/2"]
    assert bench.skips("host,train") == {"host", "train"} and bench.skips("") == set()
    bad_types = [(positive_ints, bad, "must be whole numbers") for bad in ("1,x", "0", "1,,2")]
    bad_types += [(bench.specs, bad, "must be among") for bad in ("1/4", "1/2,", "half", "1/2,1/2")]
    bad_types += [(bench.skips, bad, "must be among") for bad in ("hosts", "train,engine")]
    for kind, bad, message in bad_types:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            kind(bad)
    # And argparse takes them as the options' types: one bad value each, every script's parser run in one subprocess
    # (its imports paid once), as `python SCRIPT ARGS` would run it.
    cases = [("bench_lookup_kernel", "--tokens", "1,x", "must be whole numbers"),
             ("bench_gpu", "--decode-batches", "0", "must be whole numbers"),
             ("bench_gpu", "--specs", "1/4", "must be among 1/3, 1/2, full"),
             ("bench_gpu", "--skip", "train,engine", "must be among prefill")]  # fmt: skip
    runs = [[f"benchmarks/{script}.py", ["--device", "cpu", option, bad, "--out", str(tmp_path / f"{script}.json")]]
            for script, option, bad, _ in cases]  # fmt: skip
    for (script, option, _, message), (code, stderr) in zip(cases, parse_benchmark_runs(runs), strict=True):
        assert code == 2 and f"argument {option}: {message}" in stderr, (script, code, stderr)
        assert not (tmp_path / f"{script}.json").exists()


def test_the_gpu_check_runs_a_benchmark_script_and_keeps_its_json_or_its_error(tmp_path, monkeypatch):
    """`gpu_check.run_script`, which runs `bench_lookup_kernel.py`, `bench_gpu.py` and `profile_gpu.py` for the GPU
    check: the script's JSON lands in the check's report; a script that fails raises with its error."""
    import time

    check = benchmark_script("gpu_check")
    tiny = ["--device", "cpu", "--tokens", "130", "--d-ff", "32", "--vocab", "60", "--rounds", "1", "--inner", "1"]
    bench = {}
    check.run_script("bench_lookup_kernel", tiny, time.monotonic() + 300, bench, key="lookup_kernel", results=tmp_path)
    assert [case["tokens"] for case in bench["lookup_kernel"]["cases"]] == [130, 130]
    with pytest.raises(RuntimeError, match="exit status"):
        check.run_script("bench_lookup_kernel", ["--no-such-flag"], time.monotonic() + 300, {}, results=tmp_path)
    # Its profile part names variants profile_gpu knows, dense beside STEM for prefill and train (their `bounds`).
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    variants = benchmark_script("profile_gpu").VARIANTS
    assert set(check.PROFILED) <= variants.keys()
    for what in ("prefill", "train"):
        assert {variants[name][1] is None for name in check.PROFILED if variants[name][0] == what} == {True, False}


def test_the_gpu_profile_runs_on_cpu_and_names_where_the_time_goes(tmp_path):
    """`benchmarks/profile_gpu.py` at a tiny shape on the CPU (the host-table variants need an accelerator; the offload
    engine serves a CPU model too): each variant's totals, and its top operators, the matrix products among them; what
    each STEM variant saves in matrix products beside its dense one, again from the saved profile."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "profile.json"
    command = [sys.executable, os.path.join(root, "benchmarks/profile_gpu.py"), "--device", "cpu", "--shape", "tiny",
               "--batch-size", "2", "--seq-len", "16", "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {"prefill_dense", "prefill_stem_full_resident", "prefill_stem_1_2_engine", "train_dense",
                "train_stem_1_2_resident", "decode_b64_stem_1_2_resident"}  # fmt: skip
    assert expected <= report.keys() and not any(k.endswith("_host") for k in report)
    for name in expected:
        row = report[name]
        assert row["wall_ms"] > 0 and row["device_ms"] > 0 and row["host_ms"] > 0
        assert "aten::mm" in {op["op"] for op in row["top_device"]}
        assert 0 < row["matmul_device_ms"] < row["device_ms"]
    # What STEM saves in matrix products, beside its dense variant: the speedup those alone give, by hand.
    bounds = report["bounds"]
    assert bounds.keys() == {"prefill_stem_full_resident", "train_stem_1_2_resident", "decode_b64_stem_1_2_resident"}
    for name, bound in bounds.items():
        dense, stem = report[bound["dense"]], report[name]
        saved = dense["matmul_device_ms"] - stem["matmul_device_ms"]
        assert bound["matmul_saved_ms"] == pytest.approx(saved, abs=2e-3)  # its sign: noise at this shape
        expected = dense["device_ms"] / (dense["device_ms"] - saved)
        assert bound["speedup_matmuls_alone"] == pytest.approx(expected, abs=2e-3)
    assert bounds["train_stem_1_2_resident"]["stem_layers"] == 2  # tiny: 4 layers, 1 and 3
    assert bounds["prefill_stem_full_resident"]["speedup_matmuls_alone_full"] == pytest.approx(
        bounds["prefill_stem_full_resident"]["speedup_matmuls_alone"], abs=2e-3
    )  # full is full
    again = subprocess.run(command[:2] + ["--bounds-of", str(out), "--out", str(tmp_path / "bounds.json")],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "bounds.json").read_text())["bounds"] == bounds
    bad = subprocess.run(command[:2] + ["--bounds-of", str(out), "--out", str(out)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert bad.returncode == 2 and "--out is the profile read" in bad.stderr
    bad = subprocess.run(command[:2] + ["--only", "prefill_nope"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert bad.returncode == 2 and "prefill_nope" in bad.stderr


# An out-of-range id under torch.compile (issue 23; issue 36 changed what a compiled forward does)


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


# Compiled training with sparse table gradients (issue 36): the rows outside the graph, the layers inside it


def _sparse_step(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name.removeprefix("_orig_mod."): param.grad for name, param in model.named_parameters()}


@pytest.mark.slow
def test_a_compiled_training_forward_does_not_recompile_where_a_batch_crosses_the_fused_lookup_threshold():
    """A compiled train step never fuses its lookups, so the token count that decides fusing in inference
    (`FUSED_LOOKUP_MIN_TOKENS`) must not become a guard of its graph: batches on either side of it share one graph."""
    model = tiny_model().train()
    lengths = {"below": (20, 40), "across": (40, 70)}  # batch 2: 40 and 80 tokens; 80 and 140 (128 and more fuse)
    assert 2 * 40 < modeling_stem.FUSED_LOOKUP_MIN_TOKENS <= 2 * 70
    graphs = {}
    for name, sizes in lengths.items():
        made = []

        def backend(graph, example_inputs, made=made):
            made.append(graph)
            return graph.forward

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=True)
        for length in sizes:
            ids = _ids(length, (2, length))
            torch.testing.assert_close(compiled(ids, labels=ids).loss, model(ids, labels=ids).loss)
        graphs[name] = len(made)
    torch._dynamo.reset()
    assert graphs["across"] == graphs["below"], graphs


@pytest.mark.slow
def test_compiled_training_keeps_sparse_table_gradients_with_one_graph_break_before_the_layers(monkeypatch):
    """Under `torch.compile` (inductor) a sparse table's rows are gathered by the eager path outside the graph, once per
    forward: the tables' gradients are sparse over the batch's distinct rows and equal eager's, every other gradient
    too, step after step on other ids, and the layers' loop compiles whole (as many graphs at 2 layers as at 6: none
    per layer). Layers compiled one by one gather each its own. Frozen and dense tables stay in the graph, and
    activation checkpointing recomputes the layers around the rows. Without gradients the forward compiles with
    `fullgraph=True`; with them `fullgraph=True` fails and says why."""
    from torch._dynamo.utils import counters

    from stem_hf.training import use_sparse_table_grads

    calls = []
    for name in ("rows_outside_graph", "_rows_outside_graph_of"):
        original = getattr(modeling_stem, name)

        @torch.compiler.disable
        def counted(*args, original=original, name=name):
            calls.append((name, args[-1]))
            return original(*args)

        monkeypatch.setattr(modeling_stem, name, counted)
    steps = [_ids(seed, (2, 10)) for seed in (3, 4)]
    graphs = {}
    for layers in (2, 6):
        model = sensitive_model(num_hidden_layers=layers, stem_layers="full").train()
        use_sparse_table_grads(model)
        eager = [_sparse_step(model, ids) for ids in steps]
        assert not calls  # eager: nothing gathered ahead
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model)
        for ids, (eager_loss, eager_grads) in zip(steps, eager, strict=True):  # the second recompiles nothing
            loss, grads = _sparse_step(compiled, ids)
            torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
            for name, grad in grads.items():
                if ".stem_tables." in name:
                    assert grad.is_sparse and eager_grads[name].is_sparse, name
                    assert torch.equal(grad.coalesce().indices()[0], ids.unique()), name  # the batch's rows only
                torch.testing.assert_close(
                    grad.to_dense(), eager_grads[name].to_dense(), rtol=1e-4, atol=1e-5, msg=name
                )
        graphs[layers] = counters["stats"]["unique_graphs"]
        # Every table ("full": each layer but 0), once per forward.
        assert calls == [("rows_outside_graph", tuple(range(1, layers)))] * 2
        calls.clear()
    assert graphs[2] == graphs[6], graphs
    # Layers compiled one by one (accelerate's regional compilation): each gathers its own rows outside its graph,
    # from the forward's own rows (its distinct ids computed once).
    ids, (eager_loss, eager_grads) = steps[1], eager[1]
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile()
    loss, grads = _sparse_step(model, ids)
    assert calls == [("_rows_outside_graph_of", layer) for layer in range(1, 6)]
    calls.clear()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        assert grad.is_sparse is (".stem_tables." in name), name
        torch.testing.assert_close(grad.to_dense(), eager_grads[name].to_dense(), rtol=1e-4, atol=1e-5, msg=name)
    # A frozen table and a dense one in the graph, one sparse outside, the layers checkpointed.
    model = sensitive_model(num_hidden_layers=4, stem_layers="full").train()
    use_sparse_table_grads(model)
    model.model.stem_tables["1"].weight.requires_grad_(False)
    model.model.stem_tables["2"].sparse = False
    model.gradient_checkpointing_enable()
    eager_loss, eager_grads = _sparse_step(model, ids)
    torch._dynamo.reset()
    loss, grads = _sparse_step(torch.compile(model), ids)
    assert calls == [("rows_outside_graph", (3,))]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    assert grads["model.stem_tables.1.weight"] is None and not grads["model.stem_tables.2.weight"].is_sparse
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(grad.to_dense(), eager_grads[name].to_dense(), rtol=1e-4, atol=1e-5, msg=name)
    model.gradient_checkpointing_disable()
    monkeypatch.undo()  # the model's own function, whose reason dynamo gives
    torch._dynamo.reset()  # what the compiles above cached would serve the calls below
    with torch.no_grad():
        logits = torch.compile(model, fullgraph=True)(ids).logits
    torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="compile without fullgraph"):
        torch.compile(model, fullgraph=True)(ids, labels=ids)


@pytest.mark.slow
def test_compiled_training_fetches_host_tables_rows_ahead_outside_the_graph(monkeypatch):
    """Tables in host memory (routed here on the CPU, as the host path's tests do) under `torch.compile` in training:
    outside the graph their rows come by the host path, fetched ahead by the worker (`_fetch`, once per table and
    forward), with sparse gradients over the batch's distinct rows (`StemHostRowsGrad`), equal to eager's."""
    from stem_hf.training import use_sparse_table_grads

    monkeypatch.setattr(modeling_stem.StemTableRows, "host_served", lambda self, table: True)
    fetched, fetch = [], modeling_stem.StemTableRows._fetch
    monkeypatch.setattr(modeling_stem.StemTableRows, "_fetch", lambda self, *a: fetched.append(1) or fetch(self, *a))
    ids = _ids(4, (2, 10))
    model = sensitive_model().train()
    use_sparse_table_grads(model)
    eager_loss, eager = _sparse_step(model, ids)
    assert len(fetched) == 2  # two tables, one forward
    torch._dynamo.reset()
    loss, grads = _sparse_step(torch.compile(model), ids)
    assert len(fetched) == 4
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        assert grad.is_sparse is (".stem_tables." in name), name
        torch.testing.assert_close(grad.to_dense(), eager[name].to_dense(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("grad, wrapped", [(False, False), (True, True)])  # each way of compiling, each mode
def test_layers_compiled_one_by_one_start_no_host_row_fetch_they_would_not_read(monkeypatch, grad, wrapped):
    """Decoder layers compiled one by one (`layer.compile()`, or each replaced by `torch.compile(layer)` as accelerate's
    regional compilation does) trace their own lookups, so a forward over host tables (routed here on the CPU) starts
    no fetch before them, which would go unread; the logits and gradients are those of the eager model."""
    monkeypatch.setattr(modeling_stem.StemTableRows, "host_served", lambda self, table: True)
    ids = _ids(5, (2, 10))
    model = sensitive_model(table_dtype="float32")
    with torch.set_grad_enabled(grad):
        expected = model(ids).logits
        if grad:
            expected.sum().backward()
            expected_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
            model.zero_grad()
    started = []
    for name in ("start", "_fetch_at_once", "_fetch_ahead"):
        original = getattr(modeling_stem.StemTableRows, name)
        monkeypatch.setattr(
            modeling_stem.StemTableRows, name, lambda self, *a, f=original, n=name: started.append(n) or f(self, *a)
        )
    torch._dynamo.reset()
    for i, layer in enumerate(model.model.layers):
        if wrapped:
            model.model.layers[i] = torch.compile(layer, backend="eager")
        else:
            layer.compile(backend="eager")
    with torch.set_grad_enabled(grad):
        logits = model(ids).logits
        if grad:
            logits.sum().backward()
    assert started == []
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    if grad:
        for name, param in model.named_parameters():
            name = name.replace("._orig_mod", "")
            torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_gpu_benchmarks_host_and_engine_cases_run_when_routed_through_the_cpu(monkeypatch):
    """`bench_gpu.py`'s host-table and engine cases of prefill and decode, which run on an accelerator only, here on
    the CPU (tables "moved" to the host stay where they are): every figure they write, so a GPU session's minutes are
    not lost to a slip in them."""
    import argparse

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    bench = benchmark_script("bench_gpu")
    monkeypatch.setattr(bench, "hosts", lambda args, device: True)
    args = argparse.Namespace(shape="tiny", batch_size=2, seq_len=16, repeats=1, compile=False, dtype="float32",
                              skip=set(), specs=["1/2"], decode_batches=[1], prompt_len=8, new_tokens=3)  # fmt: skip
    prefill = bench.run_prefill(args, torch.device("cpu"))["1/2"]
    for kind in ("uniform", "zipf"):
        row = prefill[kind]
        assert row["host_first_ms"] > 0 and row["engine_first_ms"] > 0
        assert row["host_vs_resident"] == pytest.approx(row["resident_ms"] / row["host_ms"], rel=1e-2, abs=2e-3)
        assert row["engine_vs_resident"] == pytest.approx(row["resident_ms"] / row["engine_ms"], rel=1e-2, abs=2e-3)
    decode = bench.run_decode(args, torch.device("cpu"))["batch_1"]
    for name in ("host", "engine"):  # the same tokens and logits as resident tables, and a ratio to dense
        assert decode[name]["same_tokens_as_resident"] is True and decode[name]["logits_max_diff_vs_resident"] == 0
        assert decode[name]["speedup"] > 0
