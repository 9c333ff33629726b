"""`stem-hf verify`: a load's file checks plus a scan of every weight for NaN and inf, which no load does."""

import json
import struct

import pytest
import torch

from stem_hf import StemForCausalLM
from stem_hf.checkpoint_stem import read_safetensors_header
from stem_hf.verify import non_finite_rows, verify_checkpoint
from tests.conftest import tiny_model

TABLES = "stem-tables-00001-of-00001.safetensors"


def _overwrite_row(path, tensor: str, row: int, value: bytes) -> None:
    """Overwrites one row of a tensor in a safetensors file in place, header untouched: a disk error, a stray write."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + size])[tensor]
    width, itemsize = entry["shape"][1], {"BF16": 2, "F16": 2, "F32": 4}[entry["dtype"]]
    begin = 8 + size + entry["data_offsets"][0] + row * width * itemsize
    data[begin : begin + width * itemsize] = value * width
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_a_whole_checkpoint_verifies_with_every_tensor_scanned(saved):
    model, folder = saved
    report = verify_checkpoint(folder)
    assert report["non_finite"] == {} and report["tensors"] == len(model.state_dict())
    stored = [read_safetensors_header(str(p)) for p in folder.glob("*.safetensors")]
    assert report["bytes"] == sum(e["data_offsets"][1] - e["data_offsets"][0] for h in stored for e in h.values())


def test_a_nan_row_written_into_a_table_loads_but_verify_names_it(saved):
    model, folder = saved
    _overwrite_row(folder / TABLES, "model.stem_tables.3.weight", 7, b"\xc0\x7f")  # bf16 NaN
    loaded = StemForCausalLM.from_pretrained(folder)  # no checksum: the load cannot see it
    assert torch.isnan(loaded.model.stem_tables["3"].weight[7]).all()
    report = verify_checkpoint(folder)
    assert report["non_finite"] == {"model.stem_tables.3.weight": {"count": 64, "rows": [7]}}


def test_non_finite_rows_reads_in_blocks_and_names_the_first_rows(monkeypatch):
    from stem_hf import verify

    monkeypatch.setattr(verify, "SCAN_BYTES", 64)  # 4 rows of 4 float32 a block
    t = torch.zeros(10, 4)
    t[2, 1], t[5, 0], t[9, 3] = float("nan"), float("inf"), float("-inf")
    assert non_finite_rows(t) == (3, [2, 5, 9])
    assert non_finite_rows(t, limit=2) == (3, [2, 5])
    assert non_finite_rows(torch.arange(4)) == (0, [])  # integers hold no NaN


def test_verify_raises_what_a_load_raises_on_a_broken_file(saved):
    model, folder = saved
    data = (folder / TABLES).read_bytes()
    (folder / TABLES).write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        verify_checkpoint(folder)


def test_the_cli_prints_the_report_and_exits_non_zero_on_a_nan(saved, capsys):
    from stem_hf.cli import main

    model, folder = saved
    main(["verify", str(folder)])
    assert json.loads(capsys.readouterr().out)["non_finite"] == {}
    _overwrite_row(folder / TABLES, "model.stem_tables.1.weight", 0, b"\x80\x7f")  # bf16 inf
    with pytest.raises(SystemExit, match="1 tensor\\(s\\) hold NaN or inf"):
        main(["verify", str(folder)])
    assert json.loads(capsys.readouterr().out)["non_finite"]["model.stem_tables.1.weight"]["rows"] == [0]
    (folder.parent / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not a STEM one"):
        main(["verify", str(folder.parent)])


def test_float8_weights_are_scanned_and_a_folder_without_weights_is_named(tmp_path, monkeypatch):
    t = torch.zeros(3, 4).to(torch.float8_e4m3fn)
    t.view(torch.uint8)[1, 2] = 0x7F  # NaN in e4m3fn
    assert non_finite_rows(t) == (1, [1])
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder)
    for file in folder.glob("*.safetensors*"):
        file.unlink()
    with pytest.raises(FileNotFoundError, match="holds no safetensors weights"):
        verify_checkpoint(folder)
