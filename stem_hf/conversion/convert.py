"""`convert`: a dense Llama-family checkpoint to a STEM checkpoint, with tables initialized from the dense weights.

The driver: each step is a call into the module that does it (`sources`, `text`, `init_tables`, `refit`, `heal`,
`report`, `save`); `run_conversion` reads top to bottom, one line per step.
"""

import os
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from .. import StemConfig, StemForCausalLM
from ..accounting import num_active_parameters, num_table_parameters, summarize, table_bytes
from ..offload import write_offload_store
from ..system import available_memory, check_disk_room, format_bytes
from .heal import heal
from .init_tables import init_tables
from .plan import ConversionPlan
from .refit import refit
from .report import ConversionReport, perplexity
from .save import StemTableStream, save_conversion
from .sources import Source, check_source_and_out, open_source, stem_config_from_dense, stem_from_dense
from .text import Chunks, ConversionText, prefix_ids

__all__ = ["convert", "run_conversion"]


def convert(
    source: str | os.PathLike | nn.Module,
    out: str | os.PathLike | None = None,
    stem_layers: str | list[int] = "1/3",
    init: str = "fitted",
    calibration: Sequence = (),
    calibration_tokens: int | None = None,
    heldout: Sequence = (),
    heldout_tokens: int | None = None,
    table_dtype: str = "bfloat16",
    tokenizer: object | None = None,
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
    stream: bool | None = None,
    max_shard_size: int | str = "50GB",
    offload_store: bool = False,
) -> tuple[StemForCausalLM, dict]:
    """Converts `source` (a folder, Hub id, `.gguf` file, or a loaded Llama/Mistral/Qwen2/Qwen3 model) to STEM and
    returns `(model, report)`; saves to `out` when given (with the tokenizer, generation config, the conversion report
    and a model card). `check_source_and_out` runs before anything loads: `out` is never the source's own folder.

    The options are `ConversionPlan`'s (how: layers, init, refit, local training, healing) and `ConversionText`'s (on
    what: `calibration` and `heldout` texts, their token caps, `chunk_len`, and what to call them in the report), which
    document each. `tokenizer` tokenizes text given as strings (default: the source's own). For the report and the
    model card, `base_model` is the source's Hub id (default: `source` when it is one) and `license` its license id
    (e.g. "apache-2.0"). `run_conversion` takes the options grouped.
    """
    plan = ConversionPlan(
        stem_layers=stem_layers,
        init=init,
        table_dtype=table_dtype,
        shrink=shrink,
        prior_context=prior_context,
        refit=refit,
        gate_epochs=gate_epochs,
        dense_epochs=dense_epochs,
        heal_tokens=heal_tokens,
        heal_options=heal_options or {},
        device=device,
        stream=stream,
        max_shard_size=max_shard_size,
        offload_store=offload_store,
    )
    text = ConversionText(
        calibration=calibration,
        calibration_tokens=calibration_tokens,
        heldout=heldout,
        heldout_tokens=heldout_tokens,
        chunk_len=chunk_len,
        calibration_name=calibration_name,
        heldout_name=heldout_name,
    )
    return run_conversion(source, out, plan, text, tokenizer, base_model, license)


def run_conversion(
    source: str | os.PathLike | nn.Module | Source,
    out: str | os.PathLike | None,
    plan: ConversionPlan,
    text: ConversionText,
    tokenizer: object | None = None,
    base_model: str | None = None,
    license: str | None = None,
) -> tuple[StemForCausalLM, dict]:
    """`convert` with its options grouped: `plan` says how, `text` on what. `source` may also be a `Source`: a loaded
    model with its tokenizer and what the report calls it."""
    _check_before_loading(source, out, plan, text)
    start = time.perf_counter()
    dense = open_source(source, tokenizer, base_model, license)
    streamed = out is not None and plan.stream
    # A dense model loaded here and never written to (no refit, no healing) lends the STEM model its tensors.
    share = isinstance(source, (str, os.PathLike)) and plan.refit == "none" and not plan.heal_tokens
    if not isinstance(source, (str, os.PathLike)):  # a loaded model: its config is at hand only now
        planned = stem_config_from_dense(dense.model.config, plan.stem_layers, plan.table_dtype)
        _check_tables_fit(planned, streamed)
        _check_disk(planned, out, plan.offload_store)
    stem = stem_from_dense(dense.model, plan.stem_layers, plan.table_dtype, not streamed, share)
    with StemTableStream(out, stem, plan.max_shard_size) if streamed else nullcontext() as stream:
        chunks, prefix = _cut_text(text, dense.tokenizer, stem.config, plan)
        write = stream.write if stream is not None else None
        calibration = init_tables(
            dense.model, stem, plan.init, chunks.calibration, plan.shrink, prior_prefix=prefix, write=write,
            memory_budget=_calibration_budget(stem.config, streamed),
        )  # fmt: skip
        if stream is not None:
            stream.map_tables()
        trained = _refit(dense.model, stem, chunks.calibration, plan)
        report = _report(dense, stem, plan, text, chunks, calibration, trained, prefix)
        _heal(dense.model, stem, chunks, plan, report)
        _count(stem, report, start)
        if out is not None:
            save_conversion(out, stem, dense.tokenizer, report, stream, plan.max_shard_size)
    if out is not None and plan.offload_store and stem.config.stem_layers:
        write_offload_store(out)
    return stem, report.to_dict()


def _check_before_loading(
    source: str | os.PathLike | nn.Module | Source,
    out: str | os.PathLike | None,
    plan: ConversionPlan,
    text: ConversionText,
) -> None:
    """What can be refused before the weights load (`check_source_and_out`; the calibration text the plan needs)."""
    if plan.heal_tokens and not text.calibration:
        raise ValueError("heal_tokens: healing distils on calibration text, and none was given (--calibration)")
    if out is None and plan.offload_store:
        raise ValueError("offload_store: the store is written beside a saved checkpoint; give an output folder")
    planned = check_source_and_out(source, out, plan.stem_layers, plan.table_dtype)
    if planned is not None:
        plan.check_calibration(planned.stem_layers, bool(text.calibration))
        _check_tables_fit(planned, streamed=out is not None and plan.stream)
        _check_disk(planned, out, plan.offload_store)


def _check_disk(config: StemConfig, out: str | os.PathLike | None, offload_store: bool) -> None:
    """Raises where the filesystem of `out` has less room than the checkpoint (tables, and dense weights in fp32 as
    the conversion holds them) plus the offload store when asked for: the table files grow as rows come and the dense
    weights are written last, so a full disk would otherwise show only hours in."""
    if out is None:
        return
    counts, tables = summarize(config), table_bytes(config)
    needed = tables * (2 if offload_store else 1) + 4 * (counts["total_params"] - counts["table_params"])
    what = f"the checkpoint{' and its offload store' if offload_store else ''} take"
    check_disk_room(out, needed, what, f" ({format_bytes(tables)} of tables)")


def _calibration_budget(config: StemConfig, streamed: bool) -> int | None:
    """Bytes the calibrated inits may hold statistics in: half the memory available, less the tables a conversion
    in memory is about to fill (allocated, so not yet counted as used)."""
    available = available_memory()
    if available is None:
        return None
    return max(0, available - (0 if streamed else table_bytes(config))) // 2


def _check_tables_fit(config: StemConfig, streamed: bool) -> None:
    """Raises where a conversion would hold tables larger than the memory available: one that does not stream them
    (no output folder, healing, or `stream=False`)."""
    needed, available = table_bytes(config), available_memory()
    if not streamed and available is not None and needed > available:
        raise MemoryError(
            f"the tables take {needed / 2**30:.1f} GiB and {available / 2**30:.1f} GiB of memory are available: a "
            "conversion that keeps them in memory (no output folder, healing, or stream=False / --in-memory) cannot "
            "hold them; convert to an output folder without healing, which streams them to disk"
        )


def _cut_text(
    text: ConversionText, tokenizer: object, config: StemConfig, plan: ConversionPlan
) -> tuple[Chunks, list[int] | None]:
    """The text's chunks, and the token ids of the prior context (None without one)."""
    chunks = Chunks.cut(text, tokenizer, config.bos_token_id, plan.heal_tokens)
    plan.check_calibration(config.stem_layers, bool(chunks.calibration))
    if plan.prior_context is None or not config.stem_layers:
        return chunks, None
    return chunks, prefix_ids(plan.prior_context, tokenizer, config.bos_token_id)


def _refit(dense: nn.Module, stem: StemForCausalLM, chunks: list[torch.Tensor], plan: ConversionPlan) -> list[int]:
    """Refits as the plan asks (`conversion.refit`); returns the layers trained locally."""
    if plan.refit == "none" or not stem.config.stem_layers:
        return []
    return refit(dense, stem, chunks, plan.refit, gate_epochs=plan.gate_epochs, dense_epochs=plan.dense_epochs)


def _heldout_perplexity(model: nn.Module, chunks: Chunks) -> float | None:
    return perplexity(model, chunks.heldout) if chunks.heldout else None


def _report(
    dense: Source,
    stem: StemForCausalLM,
    plan: ConversionPlan,
    text: ConversionText,
    chunks: Chunks,
    calibration: dict,
    trained: list[int],
    prefix: list[int] | None,
) -> ConversionReport:
    """The report of the conversion so far (`calibration`: `init_tables`' facts, `trained`: the layers the refit
    trained locally, `prefix`: the prior context's ids), its perplexities scored on the held-out text."""
    converted = bool(stem.config.stem_layers)
    calibration_data, heldout_data = text.describe()
    return ConversionReport(
        source=dense.name,
        source_architecture=type(dense.model).__name__,
        base_model=dense.base_model,
        license=dense.license,
        stem_layers=stem.config.stem_layers,
        init=plan.init,
        prior_context=plan.prior_context if prefix is not None else None,
        refit=plan.refit if converted else "none",
        gate_epochs=plan.gate_epochs if converted else 0,
        dense_epochs=plan.dense_epochs if converted else 0,
        locally_trained_layers=trained,
        table_dtype=plan.table_dtype,
        bos_prepended=stem.config.bos_token_id is not None,
        **calibration,
        calibration_data=calibration_data,
        heldout_data=heldout_data,
        heldout_tokens=sum(len(c) for c in chunks.heldout),
        heldout_perplexity_dense=_heldout_perplexity(dense.model, chunks),
        heldout_perplexity_stem=_heldout_perplexity(stem, chunks),
    )


def _heal(
    dense: nn.Module, stem: StemForCausalLM, chunks: Chunks, plan: ConversionPlan, report: ConversionReport
) -> None:
    """Heals `stem` when the plan asks for it, on the calibration text after the calibration tokens."""
    if not plan.heal_tokens:
        return
    healing, report.heal_text = chunks.healing, "calibration text after the calibration tokens"
    if sum(len(c) for c in healing) < plan.heal_tokens:  # the text ran out: cycle through all of it
        healing = healing + chunks.calibration
        report.heal_text += " (too short: followed by the calibration tokens again)"
    report.heldout_perplexity_stem_before_healing = report.heldout_perplexity_stem
    if plan.device is not None:
        dense.to(plan.device)
        stem.to(plan.device)
    report.healing = heal(dense, stem, healing, plan.heal_tokens, **plan.heal_options)
    report.heldout_perplexity_stem = _heldout_perplexity(stem, chunks)


def _count(stem: StemForCausalLM, report: ConversionReport, start: float) -> None:
    """The converted model's sizes, and the conversion's time since `start` (the save aside)."""
    report.total_params = stem.num_parameters()
    report.active_params_per_token = num_active_parameters(stem)
    report.table_params = num_table_parameters(stem)
    report.wall_time_s = time.perf_counter() - start
