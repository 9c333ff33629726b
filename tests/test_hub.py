"""push_to_hub and `stem-hf push` against a loopback fake Hub, and loading back by repo id in a fresh interpreter that
cannot import stem_hf: every file a STEM checkpoint needs goes up, and the logits come back the same."""

import json

import pytest
import torch
from huggingface_hub import ModelCard

from stem_hf.hub import push_checkpoint
from stem_hf.model_card import MARKER
from stem_hf.remote_check import load_without_package
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model
from tests.fake_hub import fake_hub, hub_env, run_against_hub

CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "compat_stem.py",
    "configuration_stem.py",
    "modeling_stem.py",
    "checkpoint_stem.py",
    "model.safetensors.index.json",
    "model-00001-of-00001.safetensors",
    "stem-tables-00001-of-00001.safetensors",
    "README.md",
}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}


@pytest.fixture
def hub():
    with fake_hub(lifetime=300) as (endpoint, state):
        env = hub_env(endpoint)
        yield env, state


@pytest.fixture
def saved(tmp_path):
    model = tiny_model(vocab_size=BYTE_VOCAB)
    folder = tmp_path / "stem-tiny"
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model, folder


@pytest.mark.slow
def test_stem_hf_push_uploads_the_folder_and_a_package_free_load_gets_the_same_logits(hub, saved, tmp_path):
    env, state = hub
    model, folder = saved
    push = f"from stem_hf.cli import main; main(['push', {str(folder)!r}, 'user/stem-tiny'])"
    out = run_against_hub(push, env, tmp_path)
    assert "/user/stem-tiny/commit/" in out
    uploaded = set(state.repos["user/stem-tiny"])
    assert CHECKPOINT_FILES | TOKENIZER_FILES <= uploaded
    assert not [f for f in uploaded if f.startswith(".") or f.endswith(".tmp")]
    card = ModelCard(state.repos["user/stem-tiny"]["README.md"].decode())
    assert 'from_pretrained("user/stem-tiny", trust_remote_code=True)' in str(card) and "stem" in card.data.tags

    input_ids = torch.randint(3, BYTE_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    remote = load_without_package("user/stem-tiny", input_ids, max_new_tokens=2, hub_env=env)
    assert remote["module"].startswith("transformers_modules")
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], model(input_ids).logits, rtol=0, atol=0)
    assert any(r.startswith("GET /user/stem-tiny/resolve/") and "stem-tables" in r for r in state.requests)

    code = "from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('user/stem-tiny', "
    code += "trust_remote_code=True); print(t('hi').input_ids)"
    assert run_against_hub(code, env, tmp_path).strip() == str(byte_tokenizer()("hi").input_ids)


@pytest.mark.slow
def test_stem_hf_push_again_removes_stale_shards_and_keeps_a_card_edited_on_the_hub(hub, saved, tmp_path):
    env, state = hub
    model, folder = saved
    model.save_pretrained(folder, max_shard_size="20KB")  # one file per table
    push = f"from stem_hf.cli import main; main(['push', {str(folder)!r}, 'user/stem-tiny'])"
    run_against_hub(push, env, tmp_path)
    assert {"stem-tables-00001-of-00002.safetensors", "stem-tables-00002-of-00002.safetensors"} <= set(
        state.repos["user/stem-tiny"]
    )
    model.save_pretrained(folder)  # one file for both tables
    state.repos["user/stem-tiny"]["README.md"] = b"# Edited on the Hub\n"
    run_against_hub(push, env, tmp_path)
    files = state.repos["user/stem-tiny"]
    tables = sorted(f for f in files if f.startswith("stem-tables-"))
    assert tables == ["stem-tables-00001-of-00001.safetensors"]
    assert files["README.md"] == b"# Edited on the Hub\n"


@pytest.mark.slow
def test_model_push_to_hub_uploads_a_loadable_model_with_its_card_and_provenance(hub, tmp_path):
    env, state = hub
    model = tiny_model()
    model.save_pretrained(tmp_path / "converted")
    report = {"source": "/models/dense", "base_model": "org/dense", "heldout_perplexity_dense": 10.0}
    (tmp_path / "converted" / "conversion_report.json").write_text(
        json.dumps({**report, "heldout_perplexity_stem": 12.5, "init": "fitted"})
    )
    code = f"""
        from stem_hf import StemForCausalLM
        model = StemForCausalLM.from_pretrained({str(tmp_path / "converted")!r})
        info = model.push_to_hub("user/pushed", tags=["my-run"])
        print(type(info).__name__, info.oid)
    """
    out = run_against_hub(code, env, tmp_path)
    assert f"CommitInfo {state.commits['user/pushed'][-1]}" in out  # what transformers' push_to_hub returns
    files = state.repos["user/pushed"]
    assert CHECKPOINT_FILES | {"conversion_report.json"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert MARKER in card.content and "my-run" in card.data.tags and card.data.base_model == "org/dense"
    assert 'from_pretrained("user/pushed", trust_remote_code=True)' in card.content
    assert "| STEM (this model) | 12.50 | 1.25x |" in card.content

    input_ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    remote = load_without_package("user/pushed", input_ids, max_new_tokens=1, hub_env=env)
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], model(input_ids).logits, rtol=0, atol=0)

    code = """
        import torch
        from tests.conftest import tiny_model
        torch.manual_seed(0)
        tiny_model().push_to_hub("user/pushed", tags=["my-run"])
    """

    files["README.md"] = b"---\nlicense: mit\n---\n# Written by hand\n"
    run_against_hub(code, env, tmp_path)
    kept = ModelCard(state.repos["user/pushed"]["README.md"].decode())
    assert "# Written by hand" in kept.content and kept.data.license == "mit" and "my-run" in kept.data.tags
    assert len(state.commits["user/pushed"]) == 2


def test_push_refuses_a_broken_or_incomplete_checkpoint_before_uploading(saved, tmp_path):
    model, folder = saved
    tables = folder / "stem-tables-00001-of-00001.safetensors"
    data = tables.read_bytes()
    tables.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        push_checkpoint(folder, "user/broken")
    tables.write_bytes(data)
    for file in folder.glob("tokenizer*"):
        file.unlink()
    with pytest.raises(ValueError, match="has no tokenizer"):
        push_checkpoint(folder, "user/broken")
