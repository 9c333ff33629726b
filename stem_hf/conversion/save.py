"""A converted checkpoint on disk: the weights, the tokenizer, the conversion report and the model card. Written at
the end from a model in memory (`save_conversion`), or as the conversion runs, tables first (`StemTableStream`)."""

import copy
import os
import uuid
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from .. import StemForCausalLM, write_model_card
from ..checkpoint_stem import (
    TABLE_KEY,
    StemSafetensorsWriter,
    read_save_id,
    staged_folder,
    table_metadata,
    table_shards,
    write_checkpoint,
)
from ..mapped import map_safetensors
from .report import ConversionReport, write_report

__all__ = ["StemTableStream", "save_conversion"]


class StemTableStream:
    """A conversion's checkpoint written while the conversion runs, so that no table is ever whole in memory. On entry
    a staged folder for `out` (`checkpoint_stem.staged_folder`) and the table shards in it (`table_shards`, at most
    `max_shard_size` each) are opened; `write` puts each block of rows `init_tables` computes straight into its shard;
    `map_tables` then gives the model its tables as copy-on-write memory maps of those files (the refit and the report
    read them; pages come and go with the page cache); `save_conversion` adds the dense weights, index, tokenizer and
    report. The folder is committed on a clean exit, then the model card is written (it names the folder it is in);
    on an error the folder is removed. The files are those `save_pretrained` writes, tables included, byte for byte."""

    def __init__(self, out: str | os.PathLike, stem: StemForCausalLM, max_shard_size: int | str = "50GB"):
        self.out, self.stem, self.max_shard_size = out, stem, max_shard_size
        self.save_id = uuid.uuid4().hex
        self.names = {int(TABLE_KEY.search(n).group(1)): n for n, _ in stem.named_parameters() if TABLE_KEY.search(n)}
        self.writers: dict[str, StemSafetensorsWriter] = {}
        self.weight_map: dict[str, str] = {}
        self.saved = False

    def __enter__(self) -> "StemTableStream":
        self._staged = staged_folder(self.out)
        self.folder = self._staged.__enter__()
        config = self.stem.config
        dtype = config.torch_table_dtype
        shapes = {name: (config.vocab_size, config.intermediate_size) for name in self.names.values()}
        try:
            for file, names in table_shards(shapes, dtype, self.max_shard_size).items():
                path = os.path.join(self.folder, file)
                writer = StemSafetensorsWriter(path, {n: shapes[n] for n in names}, dtype, table_metadata(self.save_id))
                self.writers.update(dict.fromkeys(names, writer))
                self.weight_map.update(dict.fromkeys(names, file))
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def write(self, layer: int, first_row: int, rows: torch.Tensor) -> None:
        """Writes rows `first_row...` of layer `layer`'s table (`init_tables`' `write`)."""
        self.writers[self.names[layer]].write(self.names[layer], first_row, rows)

    def _close(self) -> None:
        for writer in set(self.writers.values()):
            writer.close()

    def map_tables(self) -> None:
        """Gives the model the tables written so far as copy-on-write memory maps of their files."""
        self._close()
        tables = self.stem.model.stem_tables
        for file in sorted(set(self.weight_map.values())):
            for name, tensor in map_safetensors(os.path.join(self.folder, file)).items():
                layer = int(TABLE_KEY.search(name).group(1))
                tables[str(layer)].weight = nn.Parameter(tensor, requires_grad=tables[str(layer)].weight.requires_grad)

    def save_weights(self) -> str:
        """Config, code, dense weights and the index beside the tables; returns the save id."""
        save_dense = partial(PreTrainedModel.save_pretrained, self.stem)
        self.saved = True
        return write_checkpoint(
            self.stem, self.folder, save_dense, max_shard_size=self.max_shard_size, save_id=self.save_id,
            written=self.weight_map,
        )  # fmt: skip

    def __exit__(self, *exc) -> bool | None:
        self._close()
        if exc[0] is None and not self.saved:  # tables without config or index are no checkpoint: commit nothing
            error = RuntimeError(f"{self.out}: the table stream ended before save_weights; nothing was saved")
            self._staged.__exit__(RuntimeError, error, None)
            raise error
        suppressed = self._staged.__exit__(*exc)
        if exc[0] is None:
            write_model_card(self.out)
        return suppressed


def save_conversion(
    out: str | os.PathLike,
    stem: StemForCausalLM,
    tokenizer: object,
    report: ConversionReport,
    stream: StemTableStream | None = None,
    max_shard_size: int | str = "50GB",
) -> None:
    """Saves `stem` to `out` with `tokenizer` (when there is one), the report (tied to the weights just saved: the
    model card leaves it out once a later save replaces them) and a model card describing both. With `stream`, into
    its staged folder, beside the tables it already holds: the stream commits everything at once, then writes the
    card. Weight files hold at most `max_shard_size` bytes each (the stream's own setting when streamed)."""
    if stream is None:
        stem.save_pretrained(out, max_shard_size=max_shard_size)
        folder = out
    else:
        stream.save_weights()
        folder = stream.folder
    report.save_id, report.saved = read_save_id(folder), True
    if tokenizer is not None:
        tokenizer = copy.deepcopy(tokenizer)
        bos = stem.config.bos_token_id
        if bos is not None and tokenizer.bos_token_id == bos:
            # Every calibration chunk started with BOS and the tables hold an exact row for it at position 0: the saved
            # tokenizer prepends it by itself, so pipelines and lm-eval feed the model what it was fit on.
            tokenizer.add_bos_token = True
        tokenizer.save_pretrained(folder)
    write_report(folder, report.to_dict())
    if stream is None:  # a stream writes it once committed
        write_model_card(folder)  # again, now that the report it describes is there
