"""`accelerate launch --num_processes 2` on a CPU-only machine (gloo) with a tiny STEM model: DDP, and FSDP2 with the
tables sharded like any parameter, give the losses and weights of one process on the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_train.py")
FSDP = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "StemDecoderLayer",
    "--fsdp_state_dict_type",
    "FULL_STATE_DICT",
]


def _run(out, per_device: int, optimizer: str, launch: list[str] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, SCRIPT, str(out), str(per_device), optimizer]
    if launch is not None:
        # `--cpu` makes accelerate start a single process; without a GPU, the multi-process launchers run gloo on CPU.
        accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2"]
        command = [*accelerate, "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *launch]
        command += [SCRIPT, str(out), str(per_device), optimizer]
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return {opt: _run(tmp_path_factory.mktemp(f"single-{opt}"), 4, opt) for opt in ("row_sparse", "plain")}


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-4)
    assert a["sums"].keys() == b["sums"].keys()
    for name, (value, scale) in a["sums"].items():
        assert abs(value - b["sums"][name][0]) <= 1e-5 * scale + 1e-6, name


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_on_the_same_global_batch(single, tmp_path):
    ddp = _run(tmp_path, 2, "row_sparse", launch=["--multi_gpu"])
    assert ddp["world_size"] == 2 and "MULTI_CPU" in ddp["distributed_type"]
    _same(ddp, single["row_sparse"])


@pytest.mark.slow
def test_fsdp2_on_cpu_shards_the_tables_like_any_parameter_and_matches_one_process(tmp_path):
    script = os.path.join(ROOT, "tests", "fsdp2_train.py")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    results = []
    for launcher in ([sys.executable], [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]):
        out = tmp_path / str(len(launcher))
        out.mkdir()
        run = subprocess.run([*launcher, script, str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        results.append(json.loads((out / "result.json").read_text()))
    single_run, fsdp = results
    assert fsdp["world_size"] == 2 and fsdp["shard_rows"] == 48  # 96 table rows, half on each rank
    _same(fsdp, single_run)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="accelerate turns FSDP on only for accelerator backends (AcceleratorState never sets FSDP for MULTI_CPU); "
    "the CPU test above runs FSDP2 itself. Needs two GPUs",
)
def test_accelerate_fsdp_two_processes_shard_the_tables_and_match_one_process(single, tmp_path):
    fsdp = _run(tmp_path, 2, "plain", launch=FSDP)
    assert fsdp["world_size"] == 2 and "FSDP" in fsdp["distributed_type"]
    assert "model.stem_tables.1.weight" in fsdp["sums"]
    _same(fsdp, single["plain"])


# Tensor parallelism: the plan, and tp_plan="auto" over two gloo processes (issue 23)


def _plan_matches(plan: dict, names: set[str]) -> dict:
    import re

    generic = {re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), n) for n in names}
    return {key: key in generic for key in plan}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_tensor_parallel_plan_names_real_modules_and_covers_every_matrix_of_the_layers(qk_norm):
    model = tiny_model(qk_norm=qk_norm)
    plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()} | model._tp_plan
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    assert all(_plan_matches(plan, names).values()), _plan_matches(plan, names)
    covered = {key.removesuffix(".weight") for key in plan}
    for name, param in model.named_parameters():
        if param.ndim == 2 and name != "model.embed_tokens.weight":
            generic = ".".join("*" if part.isdigit() else part for part in name.split("."))
            assert generic.removesuffix(".weight") in covered, name
    assert plan["model.stem_tables.*.weight"] == "embedding_colwise"  # [vocab, d_ff] split along d_ff, like up_proj
    assert set(model.config.base_model_pp_plan) == {"embed_tokens", "layers", "norm"}
    assert json.loads(model.config.to_json_string()).get("base_model_tp_plan") is None  # a class setting, not saved


TP_SCRIPT = """
import sys, torch, torch.distributed as dist
from stem_hf import StemForCausalLM
model = StemForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto")
ids = torch.tensor([[1, 5, 6, 7, 9, 11]])
with torch.no_grad():
    logits = model(ids).logits
weight = model.model.stem_tables["1"].weight
model.train()
model(ids, labels=ids).loss.backward()
if dist.get_rank() == 0:
    torch.save({"logits": logits, "local": tuple(weight.to_local().shape), "placements": str(weight.placements),
                "grad": weight.grad is not None}, sys.argv[2])
"""


@pytest.mark.slow
def test_tp_plan_auto_shards_the_tables_along_intermediate_size_and_matches_one_process(tmp_path):
    model = tiny_model(table_dtype="float32")
    model.save_pretrained(tmp_path / "ck")
    with torch.no_grad():
        reference = model(torch.tensor([[1, 5, 6, 7, 9, 11]])).logits
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    run = subprocess.run(
        [*command, str(tmp_path / "ck"), str(tmp_path / "out.pt")], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "were not sharded" not in run.stderr and "match nothing" not in run.stderr
    out = torch.load(tmp_path / "out.pt")
    assert out["local"] == (96, 32) and "Shard(dim=1)" in out["placements"] and out["grad"]
    assert torch.allclose(out["logits"], reference, atol=1e-5)
