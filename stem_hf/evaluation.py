"""`stem-hf eval`: the lm-eval harness on a STEM checkpoint (or any causal LM, for the dense baseline), with STEM's
placement and dtype options, results written as JSON next to the weights so that the model card can quote them.

The shipped offline tasks (`stem_facts`, `stem_complete`, `stem_prose`, grouped as `stem_offline`) live in
`stem_hf/lm_eval_tasks` and need no Hub access; standard tasks (arc_easy, hellaswag, piqa, ...) need it.
"""

import json
import os
import re
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging

from .accounting import read_model_type
from .checkpoint_stem import RESULTS_FILE, SAVE_ID_KEY
from .configuration_stem import StemConfig
from .extras import require
from .modeling_stem import StemForCausalLM

logger = logging.get_logger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Per-task entries of lm-eval's results, merged task by task into an existing results file.
MERGED_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def load_for_eval(
    checkpoint: str | os.PathLike,
    device: str = "cpu",
    dtype: str = "auto",
    keep_tables_on_cpu: bool = True,
    *,
    tables_on_cpu: bool | None = None,
):
    """`(model, tokenizer)` from a local folder or Hub id. A STEM model on an accelerator keeps its tables in host
    memory (memory-mapped) unless `keep_tables_on_cpu=False` (`StemConfig.keep_tables_on_cpu`); `dtype` applies to
    the dense weights (tables keep `config.table_dtype`). Code shipped inside the checkpoint is never run: STEM loads
    with this package's classes. `tables_on_cpu` is the old name of `keep_tables_on_cpu` (deprecated)."""
    if tables_on_cpu is not None:
        warnings.warn(
            "load_for_eval(tables_on_cpu=...) is deprecated: pass keep_tables_on_cpu=..., the name StemConfig uses",
            FutureWarning,
            stacklevel=2,
        )
        keep_tables_on_cpu = tables_on_cpu
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    checkpoint = os.fspath(checkpoint)
    # config.json read as JSON first: a checkpoint's own code (`auto_map`) never runs. STEM loads with this package's
    # classes, anything else only with an architecture transformers ships.
    model_type = read_model_type(checkpoint)
    stem = model_type == StemConfig.model_type
    if not stem and model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{checkpoint} holds a {model_type!r} model, neither STEM nor an architecture transformers ships: "
            "stem-hf eval does not run a checkpoint's own code"
        )
    if not stem and not keep_tables_on_cpu:
        raise ValueError(f"keep_tables_on_cpu: {checkpoint} is a {model_type!r} model, which has no STEM tables")
    try:  # before the weights: a missing tokenizer is found in a second, not after the model has loaded
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{checkpoint} has no tokenizer that loads without running its own code, which lm-eval needs: save one "
            f"next to the weights ({err})"
        ) from err
    kwargs = {"dtype": dtype}
    if torch.device(device).type != "cpu":
        kwargs["device_map"] = {"": device}
    if stem:
        model = StemForCausalLM.from_pretrained(checkpoint, keep_tables_on_cpu=keep_tables_on_cpu, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=False, **kwargs)
    return model.eval(), tokenizer


def evaluate(
    model,
    tasks: list[str],
    tokenizer=None,
    *,
    batch_size: int = 1,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    include_path: str | os.PathLike | None = None,
    output: str | os.PathLike | None = None,
    seed: int = 1234,
) -> dict:
    """Runs lm-eval's `simple_evaluate` on a loaded model (`tokenizer` required) or a checkpoint path (loaded with
    `load_for_eval`'s defaults). The shipped offline tasks are always found; `include_path` adds a folder of yours.

    Returns lm-eval's results (`results`, `groups`, `configs`, `n-samples`, ...). With `output`, they are also merged
    into that JSON file (a task evaluated again replaces its earlier entry) by an atomic write, with the save id of the
    checkpoint the model was loaded from (`stem_save_id`), so that the model card drops them once another save replaces
    those weights; a file that holds results of other weights is renamed aside (`lm_eval_results.<id>-<time>.json`),
    not merged into.
    """
    lm_eval = require("lm_eval")
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("tasks: name at least one lm-eval task or group (e.g. stem_offline)")
    if output is not None:  # fail before the evaluation, not after it
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(model, (str, os.PathLike)):
        model, tokenizer = load_for_eval(model)
    elif tokenizer is None:
        raise ValueError("tokenizer: lm-eval needs the model's tokenizer next to an already-loaded model")
    paths = [str(TASKS_DIR)] + ([os.fspath(include_path)] if include_path else [])
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"tasks: lm-eval knows no task or group named {', '.join(map(repr, unknown))}")
    lm = _lm_class()(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    results = json.loads(json.dumps(results, default=_jsonable))  # what lm-eval's own writer does with odd values
    results.pop("samples", None)
    if output is not None:
        # The save of the weights evaluated (set when the model was loaded from a local checkpoint): the model card
        # quotes the results only next to those weights.
        _merge_into(Path(output), results, getattr(model, "stem_save_id", None))
    return results


def _lm_class():
    HFLM = require("lm_eval.models.huggingface").HFLM

    class StemHFLM(HFLM):
        """HFLM that encodes rolling-loglikelihood text without special tokens. lm-eval puts its own BOS prefix
        before the first window; with a tokenizer that adds BOS itself (as converted STEM checkpoints do) stock HFLM
        scores `[BOS, BOS, text]` (lm-evaluation-harness issue #3333), and a second BOS at position 1 is not what a
        converted model's exact BOS row was fit for."""

        _rolling = False

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            self._rolling = True
            try:
                return super().loglikelihood_rolling(requests, disable_tqdm)
            finally:
                self._rolling = False

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
            special = False if self._rolling else add_special_tokens
            return super().tok_encode(string, add_special_tokens=special, **kwargs)

    return StemHFLM


def _jsonable(value):
    return str(value) if not isinstance(value, torch.Tensor) else value.tolist()


def _merge_into(path: Path, results: dict, save_id: str | None = None) -> None:
    """Merges `results` into the JSON file at `path`, recording `save_id`. A file that records other weights (another
    save id) is not merged into, which would claim its results for these, nor deleted: it is renamed aside first."""
    merged = json.loads(path.read_text()) if path.is_file() else {}
    if merged and merged.get(SAVE_ID_KEY) != save_id:
        old_id = re.sub(r"[^0-9A-Za-z_-]", "_", str(merged.get(SAVE_ID_KEY) or "no-id"))[:48]
        stamp = f"{path.stem}.{old_id}-{time.strftime('%Y%m%d%H%M%S')}"
        aside, n = path.with_name(f"{stamp}.json"), 1
        while aside.exists():  # never over an earlier set-aside file
            aside, n = path.with_name(f"{stamp}-{n}.json"), n + 1
        os.replace(path, aside)
        logger.warning(
            f"{path}: the results of {', '.join(merged.get('results', {})) or 'no task'} there describe other weights "
            f"than the ones just evaluated; moved to {aside.name}"
        )
        merged = {}
    if save_id is not None:
        merged[SAVE_ID_KEY] = save_id
    for key in MERGED_KEYS:
        if key in results:
            merged[key] = {**merged.get(key, {}), **results[key]}
    # The run settings (limit, batch size...) differ between runs merged here: keep them per task.
    for task in results.get("results", {}):
        merged.setdefault("run_config", {})[task] = results.get("config", {})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(tmp, path)


def headline_metrics(results: dict) -> dict[str, dict[str, float]]:
    """`{task: {metric: value}}` from lm-eval results: each task's metrics (those it declares in `higher_is_better`),
    named with their filter unless it is "none"; stderr, aliases and sample counts left out. What the model card and
    the README tables show."""
    table = {}
    for task, metrics in results.get("results", {}).items():
        declared = results.get("higher_is_better", {}).get(task) or {}
        row = {}
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if metric not in declared or not isinstance(value, (int, float)):
                continue
            row[metric if filter_name in ("none", "") else f"{metric} ({filter_name})"] = float(value)
        if row:
            table[task] = row
    return table


__all__ = ["DTYPES", "RESULTS_FILE", "TASKS_DIR", "evaluate", "headline_metrics", "load_for_eval"]
