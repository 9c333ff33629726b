"""`convert`: a dense Llama-family checkpoint to a STEM checkpoint, with tables initialized from the dense weights."""

import copy
import json
import math
import os
import re
import time

import torch
from tqdm import tqdm

from .. import StemConfig, StemForCausalLM, write_model_card
from ..accounting import check_local, num_active_parameters, num_table_parameters
from ..storage_stem import REPORT_FILE, SAVE_ID_KEY, read_save_id
from .calibrate import calibrate, context_inputs
from .heal import ANNEAL, check_heal_options, heal
from .init_tables import calibrated_rows, projected_rows, ridge_map
from .options import CALIBRATED_INITS, INITS, LOCAL_EPOCHS, REFITS
from .refit import refit as refit_projections
from .sources import load_source, load_source_config, stem_config_from_dense

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
ROW_BLOCK = 4096  # table rows computed at a time: bounds the fp32 working set


def chunk_texts(texts, tokenizer, bos_token_id: int | None, chunk_len: int, max_tokens: int | None) -> list:
    """1-D token id chunks of at most `chunk_len`, each starting with BOS when there is one, `max_tokens` in all.
    `texts` holds strings (tokenized with `tokenizer`) or token id sequences."""
    chunks, total = [], 0
    body = chunk_len - (bos_token_id is not None)
    if body < 2:
        raise ValueError(f"chunk_len: {chunk_len} leaves no room for two tokens after BOS")
    for text in texts:
        if isinstance(text, str) and tokenizer is None:
            raise ValueError("text given as strings but the source has no tokenizer: pass `tokenizer=` or token ids")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else list(text)
        for start in range(0, len(ids), body):
            piece = ids[start : start + body]
            if len(piece) < 2:
                continue
            if bos_token_id is not None:
                piece = [bos_token_id, *piece]
            if max_tokens is not None:
                piece = piece[: max_tokens - total]
            chunks.append(torch.tensor(piece))
            total += len(piece)
            if max_tokens is not None and total >= max_tokens:
                return chunks
    return chunks


def calibration_and_healing_chunks(
    texts, tokenizer, bos_token_id: int | None, chunk_len: int, calibration_tokens: int | None, heal_tokens: int
) -> tuple[list, list]:
    """`texts` tokenized once into calibration chunks (`calibration_tokens` in all, cut as `chunk_texts` cuts them) and
    the healing text that follows them (at least `heal_tokens` where the text holds them; the rest of the chunk the
    calibration ends in is skipped). Healing reads fresh text because the tables and the refit are fit to the
    calibration tokens so closely (SmolLM2-1/3 with pseudo-count 4: 1.03x dense perplexity there, 1.65x on the text
    after them) that distilling on them again teaches the model little. The healing text is empty when nothing follows;
    `heal` then cycles what it is given."""
    budget = None if calibration_tokens is None else calibration_tokens + heal_tokens + chunk_len
    chunks = chunk_texts(texts, tokenizer, bos_token_id, chunk_len, budget)
    calibration, total = [], 0
    for chunk in chunks:
        if calibration_tokens is not None:
            if total >= calibration_tokens:
                break
            chunk = chunk[: calibration_tokens - total]
        calibration.append(chunk)
        total += len(chunk)
    return calibration, chunks[len(calibration) :]


@torch.inference_mode()
def perplexity(model, chunks: list[torch.Tensor]) -> float:
    """Token-level perplexity over `chunks` (each scored from its second token)."""
    nll, count = 0.0, 0
    device = model.get_input_embeddings().weight.device
    for chunk in chunks:
        chunk = chunk.to(device)
        logits = model(chunk[None]).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / max(count, 1))


def _copy_dense_weights(dense, stem) -> None:
    """Every dense weight but the STEM layers' up-projections, by name: STEM keeps Llama's names."""
    dropped = {f"model.layers.{i}.mlp.up_proj.{p}" for i in stem.config.stem_layers for p in ("weight", "bias")}
    state = {k: v for k, v in dense.state_dict().items() if k not in dropped}
    missing, unexpected = stem.load_state_dict(state, strict=False)
    missing = [k for k in missing if "stem_tables" not in k]
    if missing or unexpected:
        raise RuntimeError(f"dense and STEM weights do not line up: missing {missing}, unexpected {unexpected}")


@torch.inference_mode()
def init_tables(
    dense,
    stem,
    init: str,
    chunks: list[torch.Tensor],
    shrink: float = 16.0,
    ridge: float = 1e-2,
    layers: list[int] | None = None,
    prior_prefix: list[int] | None = None,
) -> dict:
    """Fills every table of `stem` (or those of `layers`) from `dense`. Returns calibration facts for the report.
    `prior_prefix` (token ids, for `mean` and `fitted`): the fallback that rare and unseen tokens' rows lean on is a
    ridge map from the token's input embedding and its FFN input after this prefix (`context_inputs`), not from the
    embedding alone."""
    layers = stem.config.stem_layers if layers is None else layers
    vocab = stem.config.vocab_size
    embed = dense.get_input_embeddings().weight.detach()
    info = {"calibration_tokens": 0, "distinct_tokens": 0, "vocab_coverage": 0.0}
    if init == "xavier" or not layers:
        return info  # the model's own init
    stats = slots = fallback = None
    if init in CALIBRATED_INITS:
        if not chunks:
            raise ValueError(f"init {init!r} needs calibration text (--calibration)")
        ids = torch.cat([c[1:] for c in chunks])
        if len(ids) == 0:
            raise ValueError(f"init {init!r}: the calibration text holds no token past position 0 of its chunks")
        seen = torch.unique(ids)
        slots = torch.full((vocab,), -1, dtype=torch.long)
        slots[seen] = torch.arange(len(seen))
        stats = calibrate(dense, chunks, layers, slots.clamp(min=0), init == "fitted")
        info = {
            "calibration_tokens": sum(len(c) for c in chunks),
            "distinct_tokens": len(seen),
            "vocab_coverage": len(seen) / vocab,
        }
    context = None
    if stats is not None and prior_prefix is not None:
        context = context_inputs(dense, layers, prior_prefix, vocab)
        embed_features = embed[:vocab].float().cpu()  # beside each layer's context inputs, which live on the CPU
    bos = stem.config.bos_token_id if chunks and all(c[0] == stem.config.bos_token_id for c in chunks) else None
    for layer in tqdm(layers, desc=f"{init} tables", unit="layer"):
        dense_layer = dense.model.layers[layer]
        table = stem.model.stem_tables[str(layer)].weight
        fallback_features = embed
        if stats is not None:
            s = stats[layer]
            if context is not None:
                fallback_features = torch.cat([embed_features, context.pop(layer)], dim=1)
            fallback = ridge_map(
                fallback_features, seen, s.sum_x[: len(seen)] / s.count[: len(seen), None].clamp(min=1), s.count, ridge
            )
        for start in range(0, vocab, ROW_BLOCK):
            rows = slice(start, min(start + ROW_BLOCK, vocab))
            if init == "projected":
                block = projected_rows(dense_layer, embed, rows)
            else:
                block = calibrated_rows(
                    dense_layer.mlp, stats[layer], slots, fallback, fallback_features, rows, init, shrink, bos
                )
            table[rows] = block.to(table.dtype)
    return info


def _local_epochs(refit: str, gate_epochs: int | None, dense_epochs: int | None) -> tuple[int, int]:
    """Epochs of local training for the STEM layers' gates and the dense layers' FFNs: it runs inside the refit along
    the stream, so only with `"sequential"` (gates) and `"all"` (both)."""
    allowed = {"gate_epochs": refit in ("sequential", "all"), "dense_epochs": refit == "all"}
    epochs = {"gate_epochs": gate_epochs, "dense_epochs": dense_epochs}
    for name, value in epochs.items():
        if value is None:
            epochs[name] = LOCAL_EPOCHS if allowed[name] else 0
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: {value!r} is not a whole number of epochs")
        elif value and not allowed[name]:
            needs = "refit 'sequential' or 'all'" if name == "gate_epochs" else "refit 'all'"
            raise ValueError(f"{name}: local training runs inside the refit along the stream ({needs}), not {refit!r}")
    return epochs["gate_epochs"], epochs["dense_epochs"]


def check_source_and_out(
    source, out: str | os.PathLike | None, stem_layers: str | list[int], table_dtype: str = "bfloat16"
) -> StemConfig | None:
    """What can go wrong before a source loads, checked from its config alone: a path source exists (a missing folder
    is named as such, not tried as a Hub id), `out` is a folder and not the source's own (saving there would replace
    the dense checkpoint), the architecture is supported and `stem_layers` fits its layers. Returns the `StemConfig`
    the conversion will build (None for an already-loaded source, whose config is checked when it is used)."""
    if out is not None and os.path.isfile(out):
        raise FileExistsError(f"out: {os.fspath(out)} is a file; the STEM checkpoint is written to a folder")
    if not isinstance(source, (str, os.PathLike)):
        return None
    source = os.fspath(source)
    gguf = source.endswith(".gguf")
    local = os.path.exists(source) if gguf else check_local(source)
    folder = os.path.dirname(os.path.abspath(source)) if gguf else source
    if out is not None and os.path.isdir(out) and os.path.isdir(folder) and os.path.samefile(out, folder):
        raise ValueError(
            f"out: {os.fspath(out)} is the source's own folder ({source}); the STEM checkpoint would replace its "
            "weights and config: choose another folder"
        )
    try:
        config = load_source_config(source)
    except OSError as error:
        if local or gguf:
            raise
        raise FileNotFoundError(
            f"{source}: no such folder, nor a Hub repo whose config could be read ({error})"
        ) from error
    return stem_config_from_dense(config, stem_layers, table_dtype)


def convert(
    source,
    out: str | os.PathLike | None = None,
    stem_layers: str | list[int] = "1/3",
    init: str = "fitted",
    calibration=(),
    calibration_tokens: int | None = None,
    heldout=(),
    heldout_tokens: int | None = None,
    table_dtype: str = "bfloat16",
    tokenizer=None,
    chunk_len: int = 512,
    shrink: float = 16.0,
    prior_context: str | None = None,
    refit: str | None = None,
    gate_epochs: int | None = None,
    dense_epochs: int | None = None,
    heal_tokens: int = 0,
    device: str | torch.device | None = None,
    heal_options: dict | None = None,
    calibration_name: str | None = None,
    heldout_name: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
) -> tuple[StemForCausalLM, dict]:
    """Converts `source` (a folder, Hub id, `.gguf` file, or a loaded Llama/Mistral/Qwen2/Qwen3 model) to STEM.

    `calibration` and `heldout` hold texts (strings, tokenized with the source's tokenizer) or token id sequences; keep
    them disjoint. `calibration_tokens` and `heldout_tokens` cap how much of each is used. `prior_context` (a text, e.g.
    " the"; `fitted` and `mean` only): rare and unseen tokens' rows lean on a fallback predicted from the token's input
    embedding and its dense FFN input after BOS and this text (`conversion.calibrate.context_inputs`), not from the
    embedding alone. `refit` (one of `REFITS`;
    default `"all"` for `fitted`, `"none"` for the others) then refits output projections in closed form:
    `"plain"` each STEM layer's `W_down` to the dense FFN's output on the dense model's activations; `"sequential"` the
    same, layer by layer along both models' residual streams, to bring the converted stream back to the dense one
    (`conversion.refit`); `"all"` also every attention `o_proj` and dense `W_down` after the first STEM layer.
    `gate_epochs` (default 5 with `"sequential"` and `"all"`) then trains each STEM layer's gate locally along the
    stream, `dense_epochs` (default 5 with `"all"`) the gate and up-projection of each dense layer it refits. With
    `heal_tokens`, the initialized model is then distilled from the dense one on that many tokens of the calibration
    text that follows the `calibration_tokens` (`calibration_and_healing_chunks`; the calibration tokens again only if
    the text runs out), `heal_options` going to `conversion.heal.heal` (`anneal` defaults to
    `conversion.heal.ANNEAL[init]`), on `device` (default: where the model is; tables stay in host memory). Saves to
    `out` (with the tokenizer, generation config, `conversion_report.json` and a model card) when given, and returns
    `(model, report)`. `check_source_and_out` runs before anything loads: `out` is never the source's own folder.

    For the report and the model card: `calibration_name` and `heldout_name` say what the texts are, `base_model` is
    the source's Hub id (default: `source` when it is one) and `license` its license id (e.g. "apache-2.0").
    """
    if init not in INITS:
        raise ValueError(f"init: {init!r} is not one of {', '.join(INITS)}")
    if refit is not None and refit not in REFITS:
        raise ValueError(f"refit: {refit!r} is not one of {', '.join(REFITS)}")
    if prior_context is not None and init not in CALIBRATED_INITS:
        raise ValueError(f"prior_context: init {init!r} has no fallback rows to predict (only fitted and mean do)")
    for name, cap in (("calibration_tokens", calibration_tokens), ("heldout_tokens", heldout_tokens)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name}: {cap} must be at least 1 (or None: all the text)")
    heal_options = {"anneal": ANNEAL[init], **(heal_options or {})}
    check_heal_options(heal_tokens, **heal_options, device=device)
    if heal_tokens and not calibration:
        raise ValueError("heal_tokens: healing distils on calibration text, and none was given (--calibration)")
    planned = check_source_and_out(source, out, stem_layers, table_dtype)  # before the weights load
    if planned is not None and planned.stem_layers and not calibration:
        planned_refit = ("all" if init == "fitted" else "none") if refit is None else refit
        for what, needed in (
            (f"init {init!r}", init in CALIBRATED_INITS),
            (f"refit {planned_refit!r}", planned_refit != "none"),
        ):
            if needed:
                raise ValueError(f"{what} needs calibration text (--calibration)")
    start = time.perf_counter()
    if isinstance(source, (str, os.PathLike)):
        dense, loaded_tokenizer = load_source(os.fspath(source))
        tokenizer = tokenizer or loaded_tokenizer
        source_name = os.fspath(source)
    else:
        dense, source_name = source.eval(), source.config.name_or_path or type(source).__name__
    config = stem_config_from_dense(dense.config, stem_layers, table_dtype)
    stem = StemForCausalLM(config).eval()
    _copy_dense_weights(dense, stem)
    stem.generation_config = dense.generation_config
    bos = config.bos_token_id
    calib_chunks, heal_chunks = calibration_and_healing_chunks(
        calibration, tokenizer, bos, chunk_len, calibration_tokens, heal_tokens
    )
    heldout_chunks = chunk_texts(heldout, tokenizer, bos, chunk_len, heldout_tokens)
    refit = ("all" if init == "fitted" else "none") if refit is None else refit
    gate_epochs, dense_epochs = _local_epochs(refit, gate_epochs, dense_epochs)
    for what, needed in ((f"init {init!r}", init in CALIBRATED_INITS), (f"refit {refit!r}", refit != "none")):
        if needed and config.stem_layers and not calib_chunks:
            raise ValueError(f"{what} needs calibration text (--calibration)")
    prior_prefix = None
    if prior_context is not None and config.stem_layers:
        if tokenizer is None:
            raise ValueError("prior_context: a text needs the source's tokenizer (pass `tokenizer=`)")
        prior_prefix = ([] if bos is None else [bos]) + tokenizer(prior_context, add_special_tokens=False)["input_ids"]
        if not prior_prefix:
            raise ValueError(f"prior_context: {prior_context!r} holds no token and the source has no BOS")
    calibration_info = init_tables(dense, stem, init, calib_chunks, shrink, prior_prefix=prior_prefix)
    locally_trained = []
    if refit != "none" and config.stem_layers:
        locally_trained = refit_projections(
            dense, stem, calib_chunks, refit, gate_epochs=gate_epochs, dense_epochs=dense_epochs
        )
    heldout_ppl = (lambda model: perplexity(model, heldout_chunks)) if heldout_chunks else (lambda model: None)
    if base_model is None and isinstance(source, str) and not os.path.exists(source) and HUB_ID.fullmatch(source):
        base_model = source
    report = {
        "source": source_name,
        "source_architecture": type(dense).__name__,
        "base_model": base_model,
        "license": license,
        "stem_layers": config.stem_layers,
        "init": init,
        "prior_context": prior_context if prior_prefix is not None else None,
        "refit": refit if config.stem_layers else "none",
        "gate_epochs": gate_epochs if config.stem_layers else 0,
        "dense_epochs": dense_epochs if config.stem_layers else 0,
        "locally_trained_layers": locally_trained,  # where local training lowered the layer's loss and was kept
        "table_dtype": table_dtype,
        # Every chunk, calibration and held-out, starts with BOS (the converted model's exact position-0 row needs it).
        "bos_prepended": bos is not None,
        **calibration_info,
        "calibration_data": calibration_name
        or (f"{len(calibration)} texts passed to convert()" if calibration else None),
        "heldout_data": heldout_name or (f"{len(heldout)} texts passed to convert()" if heldout else None),
        "heldout_tokens": sum(len(c) for c in heldout_chunks),
        "heldout_perplexity_dense": heldout_ppl(dense),
        "heldout_perplexity_stem": heldout_ppl(stem),
        "heal_tokens": 0,
    }
    if heal_tokens:
        report["heal_text"] = "calibration text after the calibration tokens"
        if sum(len(c) for c in heal_chunks) < heal_tokens:  # the text ran out: cycle through all of it
            heal_chunks = heal_chunks + calib_chunks
            report["heal_text"] += " (too short: followed by the calibration tokens again)"
        report["heldout_perplexity_stem_before_healing"] = report["heldout_perplexity_stem"]
        if device is not None:
            dense.to(device)
            stem.to(device)
        report.update(heal(dense, stem, heal_chunks, heal_tokens, **heal_options))
        report["heldout_perplexity_stem"] = heldout_ppl(stem)
    report.update(
        total_params=stem.num_parameters(),
        active_params_per_token=num_active_parameters(stem),
        table_params=num_table_parameters(stem),
    )
    if report["heldout_perplexity_dense"]:
        dense_ppl = report["heldout_perplexity_dense"]
        report["perplexity_ratio"] = report["heldout_perplexity_stem"] / dense_ppl
        if heal_tokens:
            report["perplexity_ratio_before_healing"] = report["heldout_perplexity_stem_before_healing"] / dense_ppl
    report["wall_time_s"] = time.perf_counter() - start
    if out is not None:
        stem.save_pretrained(out)
        # Ties the report to the weights just saved: the model card leaves it out once a later save replaces them.
        report[SAVE_ID_KEY] = read_save_id(out)
        if tokenizer is not None:
            tokenizer = copy.deepcopy(tokenizer)
            if bos is not None and tokenizer.bos_token_id == bos:
                # Every calibration chunk started with BOS and the tables hold an exact row for it at position 0: the
                # saved tokenizer prepends it by itself, so pipelines and lm-eval feed the model what it was fit on.
                tokenizer.add_bos_token = True
            tokenizer.save_pretrained(out)
        path = os.path.join(out, REPORT_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(path + ".tmp", path)
        write_model_card(out)  # again, now that the report it describes is there
    return stem, report
