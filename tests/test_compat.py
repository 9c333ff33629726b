"""The model under every transformers release it supports (CI runs this file under the oldest and the newest): the KV
cache under the name the installed transformers passes, generation against fixed references (tokens saved under
transformers 5.23, uncached greedy), unknown arguments refused, and the supported range checked."""

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import DynamicCache, Trainer, TrainingArguments

from stem_hf import StemForCausalLM
from stem_hf.compat_stem import CACHE_ARG, SUPPORTED_TRANSFORMERS, check_transformers_version, supports_transformers
from stem_hf.remote_check import greedy_without_cache
from tests.conftest import _dataset, benchmark_script, tiny_model

DATA = os.path.join(os.path.dirname(__file__), "data", "saved-5.23")
REFERENCE = load_file(os.path.join(DATA, "reference.safetensors"))
PROMPTS, GREEDY = REFERENCE["prompts"], REFERENCE["greedy"]
NEW_TOKENS = GREEDY.shape[1] - PROMPTS.shape[1]
MINOR = tuple(int(part) for part in transformers.__version__.split(".")[:2])


@pytest.fixture(scope="module")
def saved() -> StemForCausalLM:
    """The checkpoint saved under transformers 5.23, loaded by this package's code."""
    return StemForCausalLM.from_pretrained(os.path.join(DATA, "checkpoint")).eval()


def _generate(model: StemForCausalLM, ids: torch.Tensor = PROMPTS, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs
        )


def test_the_cache_goes_by_the_name_the_installed_transformers_uses():
    assert CACHE_ARG == ("cache" if MINOR >= (5, 24) else "past_key_values")
    model = tiny_model()
    for forward in (model.forward, model.model.forward, model.model.layers[0].forward):
        assert CACHE_ARG in inspect.signature(forward).parameters  # what generate and the checkpointing layer see
    assert CACHE_ARG in inspect.signature(model.prepare_inputs_for_generation).parameters
    assert model.config.keys_to_ignore_at_inference == [CACHE_ARG]
    assert {"cache", "past_key_values"} <= set(model._skip_keys_device_placement)


def test_a_checkpoint_saved_under_5_23_gives_its_logits_and_greedy_tokens(saved):
    with torch.no_grad():
        assert torch.equal(saved(PROMPTS).logits, REFERENCE["logits"])
    assert torch.equal(greedy_without_cache(saved, PROMPTS, NEW_TOKENS), GREEDY)
    assert torch.equal(_generate(saved), GREEDY)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_cached_generation_matches_the_saved_tokens(saved, cache_implementation):
    assert torch.equal(_generate(saved, cache_implementation=cache_implementation), GREEDY)


def test_assisted_and_prompt_lookup_generation_match_the_saved_tokens(saved):
    for row in range(PROMPTS.shape[0]):  # transformers assists one sequence at a time
        prompt = PROMPTS[row : row + 1]
        assert torch.equal(_generate(saved, prompt, assistant_model=saved), GREEDY[row : row + 1])
        assert torch.equal(_generate(saved, prompt, prompt_lookup_num_tokens=3), GREEDY[row : row + 1])


def test_the_returned_cache_holds_every_position_and_continues_the_text(saved):
    with torch.no_grad():
        out = saved.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, GREEDY)
    cache = getattr(out, CACHE_ARG)
    assert cache.get_seq_length() == GREEDY.shape[1] - 1  # the last token is generated, not yet fed back


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_generate_takes_a_callers_cache_under_either_name(saved, name):
    cache = DynamicCache(config=saved.config)
    assert torch.equal(_generate(saved, **{name: cache}), GREEDY)
    assert cache.get_seq_length() == GREEDY.shape[1] - 1
    both = {"cache": DynamicCache(config=saved.config), "past_key_values": DynamicCache(config=saved.config)}
    with pytest.raises(TypeError, match="both `cache` and `past_key_values`"):
        _generate(saved, **both)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_step_by_step_decode_takes_either_cache_name(saved, name):
    cache = DynamicCache(config=saved.config)
    ids = PROMPTS
    with torch.no_grad():
        step = ids
        for _ in range(NEW_TOKENS):
            out = saved(step, use_cache=True, **{name: cache})
            step = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, step], dim=1)
    assert getattr(out, CACHE_ARG) is cache
    assert torch.equal(ids, GREEDY)


def test_both_cache_names_or_an_unknown_argument_are_errors(saved):
    cache = DynamicCache(config=saved.config)
    with pytest.raises(TypeError, match="both `cache` and `past_key_values`"):
        saved(PROMPTS, cache=cache, past_key_values=cache)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'past_key_value'"):
        saved(PROMPTS, past_key_value=cache)  # a typo would otherwise run without a cache, silently
    with pytest.raises(TypeError, match="unexpected keyword argument.*'kv_cache'"):
        saved.model(PROMPTS, kv_cache=cache)
    with torch.no_grad():  # a name given as None is no second cache; token types mean nothing to a decoder, as in Llama
        out = saved(PROMPTS, cache=None, past_key_values=None, token_type_ids=torch.zeros_like(PROMPTS))
    assert torch.equal(out.logits, REFERENCE["logits"])


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_no_deprecation_of_the_cache_name_on_forward_generate_and_checkpointed_training(saved):
    transformers.utils.logging.warning_once.cache_clear()  # else a message logged earlier is not logged again
    handler = _Records()
    transformers.logging.get_logger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _generate(saved)
            _generate(saved, cache_implementation="static")
            model = tiny_model(table_dtype="float32")
            model.gradient_checkpointing_enable()
            model.train()
            model(PROMPTS % 96, labels=PROMPTS % 96, use_cache=True).loss.backward()
    finally:
        transformers.logging.get_logger().removeHandler(handler)
    messages = [str(w.message) for w in caught] + handler.messages
    about_cache = [m for m in messages if "past_key_values" in m or "`cache`" in m]
    assert not about_cache, about_cache
    assert not [w for w in caught if issubclass(w.category, FutureWarning) and "stem_hf" in w.filename]


def test_gradient_checkpointing_drops_a_given_cache_and_gives_the_loss_and_gradients_of_a_plain_step():
    def step(checkpointing: bool) -> tuple[torch.Tensor, dict, int]:
        torch.manual_seed(0)
        model = tiny_model(table_dtype="float32")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
        cache = DynamicCache(config=model.config)
        # The checkpointed layers must drop the cache (by the name transformers gives it), not fill it twice.
        loss = model(ids, labels=ids, use_cache=True, **{CACHE_ARG: cache}).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, cache.get_seq_length()

    plain_loss, plain_grads, plain_length = step(False)
    loss, grads, length = step(True)
    assert (plain_length, length) == (12, 0)
    assert torch.equal(loss, plain_loss)
    assert plain_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_trainer_predictions_leave_the_cache_out(tmp_path):
    model = tiny_model()
    dataset = _dataset(4)
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    predictions = Trainer(model=model, args=args).predict(dataset).predictions
    # With the cache among the outputs, predictions would be a tuple of logits and per-layer key/value tensors.
    assert isinstance(predictions, np.ndarray), type(predictions)
    assert predictions.shape == (4, len(dataset[0]["input_ids"]), model.config.vocab_size)


def test_the_supported_range_is_checked_by_minor_release():
    assert SUPPORTED_TRANSFORMERS == ">=5.18,<5.25"
    assert supports_transformers("5.18.0") and supports_transformers("5.24.3") and supports_transformers("5.24.0rc1")
    assert not supports_transformers("5.17.2") and not supports_transformers("5.25.0.dev0")
    assert not supports_transformers("6.0.0") and not supports_transformers("4.57.1")
    with pytest.warns(UserWarning, match=r"transformers>=5\.18,<5\.25 and transformers 5\.25\.0 is installed"):
        check_transformers_version("5.25.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers_version()  # the installed release is in range: no warning


@pytest.mark.slow
def test_the_copied_code_warns_under_a_transformers_outside_its_range(tmp_path, saved):
    saved.save_pretrained(tmp_path / "checkpoint")
    # The copied modeling file checks at import: load it, then import it again as if transformers were 5.99.
    code = f"""
        import importlib, importlib.abc, sys, warnings
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "stem_hf":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Block())
        from transformers import AutoModelForCausalLM
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "checkpoint")!r}, trust_remote_code=True)
        assert not [w for w in caught if "STEM model's code is tested with" in str(w.message)]
        modeling = sys.modules[type(model).__module__]
        sys.modules[modeling.check_transformers_version.__module__].transformers.__version__ = "5.99.0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.reload(modeling)
        print(type(model).__module__)
        print([str(w.message) for w in caught if "STEM model's code is tested with" in str(w.message)])
    """
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    module, messages = run.stdout.strip().splitlines()[-2:]
    assert module.startswith("transformers_modules")
    assert "transformers 5.99.0 is installed" in messages and "stem-hf refresh-code" in messages


def _served_by_continuous_batching(model: StemForCausalLM, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    """`generate_batch`'s greedy tokens per prompt, in the prompts' order (a request that fails comes back empty)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=model.config.eos_token_id)
    with torch.no_grad():
        served = model.generate_batch(prompts, generation_config=config, warmup=False, **kwargs)
    return [served[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def test_continuous_batching_generates_the_saved_and_the_uncached_greedy_tokens(saved):
    """`generate_batch` (and `transformers serve`) packs requests of several lengths (8, 8, 5 and 6 here) into one
    row, with a paged cache that the attention layers update under each transformers' protocol (from 5.24 the layer,
    given the forward's keywords; before, the attention function): the tokens of the saved reference and of full
    forwards without a cache. It failed before: the forward refused continuous batching's keywords, and the layer
    updated the paged cache without its indices."""
    shorter = [PROMPTS[:1, :5], PROMPTS[1:, :6]]
    prompts = [*PROMPTS.tolist(), *(prompt[0].tolist() for prompt in shorter)]
    with torch.no_grad():
        assert torch.equal(greedy_without_cache(saved, PROMPTS, NEW_TOKENS), GREEDY)
        later = [greedy_without_cache(saved, prompt, NEW_TOKENS)[0, prompt.shape[1] :] for prompt in shorter]
    expected = [*GREEDY[:, PROMPTS.shape[1] :].tolist(), *(tokens.tolist() for tokens in later)]
    assert _served_by_continuous_batching(saved, prompts) == expected


def test_continuous_batching_passes_only_keywords_the_forward_takes_on():
    """Every keyword continuous batching gives a forward under the installed transformers (its `PagedAttentionArgs`)
    is a named input of the model's forward or one it passes on: a release that adds one fails here, not in a
    request that comes back empty."""
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

    from stem_hf.compat_stem import MODEL_KWARGS

    named = set(inspect.signature(StemForCausalLM.forward).parameters) | {"cache"}
    assert set(PagedAttentionArgs.__annotations__) - named <= MODEL_KWARGS


def test_a_forward_captured_into_a_cuda_graph_syncs_nothing_and_refuses_rows_from_the_host(monkeypatch):
    """Continuous batching captures forwards into CUDA graphs, which allow no host sync and whose replays run no
    Python. While capturing (shown to the model as `capturing_graph`; tests/test_gpu.py captures for real), a forward
    of resident tables syncs nothing (the id check is left out, as Llama has none), and one whose rows would come from
    the host, or from a row source, raises before anything syncs, saying what to do."""
    from stem_hf import modeling_stem
    from stem_hf.host_syncs import HostSyncCounter

    model = tiny_model().eval()
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), HostSyncCounter() as syncs:
        expected = model(ids).logits
    assert syncs.count >= 1  # the id check, outside a capture
    monkeypatch.setattr(modeling_stem, "capturing_graph", lambda tensor: True)
    with torch.no_grad(), HostSyncCounter() as syncs:
        logits = model(ids).logits
    assert syncs.count == 0, syncs.by_op
    assert torch.equal(logits, expected)

    asked = []
    model.model.set_row_source(lambda stem_ids: asked.append(stem_ids))
    with pytest.raises(RuntimeError, match=r"a row source \(function\).*use_cuda_graph=False"):
        model(ids)
    assert not asked  # refused before the source ran
    model.model.set_row_source(None)
    with pytest.raises(RuntimeError, match=r"STEM tables \['1', '3'\] on another device.*keep_tables_on_cpu=False"):
        modeling_stem.refuse_graph_capture(model.model.stem_tables, ids.to("meta"), None)


def test_generate_takes_the_tokenizer_it_hands_to_every_forward_and_stops_at_stop_strings():
    """`generate(..., tokenizer=...)` (which `stop_strings` needs) hands the tokenizer to every forward, as Llama's
    forward it is dropped there, not refused: with it the tokens of plain greedy decoding, and with a stop string
    those tokens up to the first step whose text ends with it."""
    from tests.conftest import byte_tokenizer

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(vocab_size=len(tokenizer)).eval()
    prompt = torch.tensor([tokenizer("the cat").input_ids])
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model.generate(prompt, **greedy)
        assert torch.equal(model.generate(prompt, tokenizer=tokenizer, **greedy), expected)
        new = expected[0, prompt.shape[1] :].tolist()
        # A later token's text (random bytes seldom decode to text: the first that is an ASCII letter or digit)
        stop = next(text for text in map(tokenizer.decode, ([token] for token in new[1:])) if text.isalnum())
        steps = next(n for n in range(1, len(new) + 1) if tokenizer.decode(new[:n]).endswith(stop))
        stopped = model.generate(prompt, tokenizer=tokenizer, stop_strings=[stop], **greedy)
    assert steps < len(new) and torch.equal(stopped, expected[:, : prompt.shape[1] + steps])


def test_the_capture_query_stays_out_of_a_compiled_forward(monkeypatch):
    """A compiled forward on CUDA never asks whether it is being captured: dynamo would put the query in the graph,
    and its Python bool ends the graph (`fullgraph=True` fails, and without it every forward breaks once more). Shown
    here with the query answering as a CUDA build does outside a capture, on a device taken for one that captures."""
    import torch.cuda.graphs

    from stem_hf import modeling_stem

    monkeypatch.setattr(torch.cuda.graphs, "_cuda_isCurrentStreamCapturing", lambda: False)
    monkeypatch.setattr(modeling_stem, "captures_graphs", lambda device: True)
    model = tiny_model(keep_tables_on_cpu=False).eval()
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.compiler.reset()
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")(ids).logits
    torch.compiler.reset()
    torch.testing.assert_close(compiled, expected)


@pytest.mark.slow
def test_the_serving_benchmark_times_dense_and_stem_and_checks_their_tokens(tmp_path, monkeypatch):
    """`benchmarks/bench_serve.py` at a tiny shape: both models served by continuous batching, in turn, each request's
    tokens those of uncached greedy decoding, every ratio beside its FLOP prediction."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    out = tmp_path / "serve.json"
    argv = ["bench_serve.py", "--requests", "4", "--prompt-lens", "5,9", "--new-tokens", "4", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    benchmark_script("bench_serve").main()
    report = json.loads(out.read_text())
    assert report["complete"] and report["prompt_lens"] == [5, 9] and len(report["dense"]["rounds_s"]) == 1
    stem = report["stem_1_2"]
    assert stem["same_tokens_as_uncached"] and stem["s"] > 0 and stem["predicted_speedup"] > 1
    assert stem["speedup"] == pytest.approx(report["dense"]["s"] / stem["s"], rel=0.02)  # of the unrounded medians
