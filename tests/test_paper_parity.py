"""Parity with the paper's reference code (Infini-AI-Lab/STEM, on Meta Lingua) and with the paper's parameter counts.

The reference layer is written here from its description, not imported: a STEM FFN keeps `w1` (gate) and `w2` (down)
and computes `w2(silu(w1 x) * y)`, `y` the row of the layer's `[vocab, d_ff]` table for the raw input token, with no
bias, scaling or cast; a dense FFN is `w2(silu(w1 x) * w3 x)`; a block adds `ffn(ffn_norm(h), y)` to `h`. Our weights
are copied into it and both must agree on outputs and gradients."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.accounting import summarize
from stem_hf.configuration_stem import resolve_stem_layers
from stem_hf.demo import PAPER_1B
from stem_hf.modeling_stem import StemTableMLP, StemTables
from tests.conftest import sensitive_model, tiny_config

# float64 runs the same operations in the same order as the reference, so only summation order can differ.
TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
IDS = torch.tensor([[3, 7, 3, 11, 5], [7, 0, 3, 12, 1]])  # 3 three times, 7 twice; most of the vocab never


class ReferenceStemFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * y)


class ReferenceFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def reference_hidden_dim(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    hidden_dim = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


def reference_stem_ffn(mlp: StemTableMLP, dtype: torch.dtype) -> ReferenceStemFeedForward:
    ref = ReferenceStemFeedForward(mlp.gate_proj.in_features, mlp.gate_proj.out_features).to(dtype)
    with torch.no_grad():
        ref.w1.weight.copy_(mlp.gate_proj.weight)
        ref.w2.weight.copy_(mlp.down_proj.weight)
    return ref


def stem_layer_and_reference(dtype: torch.dtype):
    """Our STEM FFN with its table (looked up as the model does, through `StemTables`), and the reference with the
    same weights and a plain table tensor."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2, stem_layers=[1])
    mlp, tables = StemTableMLP(config).to(dtype), StemTables(config)
    tables["1"].to(dtype)  # the table's own cast: model-wide casts leave tables alone
    with torch.no_grad():
        tables["1"].weight.normal_()  # rows of std 1, so that a wrong reference is far from ours, not just a bit off
    ref = reference_stem_ffn(mlp, dtype)
    table = nn.Parameter(tables["1"].weight.detach().clone())
    return mlp, tables, ref, table


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stem_ffn_gives_the_reference_outputs_and_gradients(dtype):
    mlp, tables, ref, table = stem_layer_and_reference(dtype)
    x = torch.randn(*IDS.shape, 8, dtype=dtype)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    cotangent = torch.randn(*IDS.shape, 8, dtype=dtype)

    ours = mlp(x_ours, tables(IDS)[1])
    expected = ref(x_ref, table[IDS])
    torch.testing.assert_close(ours, expected, **TOLERANCES[dtype])
    (ours * cotangent).sum().backward()
    (expected * cotangent).sum().backward()
    pairs = [
        (mlp.gate_proj.weight, ref.w1.weight),
        (mlp.down_proj.weight, ref.w2.weight),
        (tables["1"].weight, table),
        (x_ours, x_ref),
    ]
    for mine, theirs in pairs:
        torch.testing.assert_close(mine.grad, theirs.grad, **TOLERANCES[dtype])

    # A table row's gradient, by hand: the sum over the positions that looked it up of silu(w1 x) * (w2^T g).
    per_position = F.silu(x @ ref.w1.weight.T) * (cotangent @ ref.w2.weight)
    by_hand = torch.zeros_like(table).index_add_(0, IDS.flatten(), per_position.flatten(0, 1))
    torch.testing.assert_close(tables["1"].weight.grad, by_hand, **TOLERANCES[dtype])
    untouched = torch.ones(len(table), dtype=torch.bool)
    untouched[IDS.flatten()] = False
    assert untouched.any() and not tables["1"].weight.grad[untouched].any()  # exactly zero where no token looked
    assert tables["1"].weight.grad[IDS.flatten()].abs().sum(-1).min() > 0
    once = per_position[0, 0] + per_position[0, 2] + per_position[1, 2]  # token 3's three positions
    torch.testing.assert_close(tables["1"].weight.grad[3], once, **TOLERANCES[dtype])


def test_a_wrong_reference_differs_from_ours():
    """The parity above can fail: a row scaled, the table in the gate's place, or the wrong token's row, all differ."""
    mlp, tables, ref, table = stem_layer_and_reference(torch.float64)
    x = torch.randn(*IDS.shape, 8, dtype=torch.float64)
    with torch.no_grad():
        ours = mlp(x, tables(IDS)[1])
        torch.testing.assert_close(ours, ref(x, table[IDS]), **TOLERANCES[torch.float64])
        wrong = {
            "scaled row": ref(x, table[IDS] * math.sqrt(table.shape[1])),
            "table as gate": ref.w2(F.silu(table[IDS]) * ref.w1(x)),
            "next token's row": ref(x, table[IDS.roll(-1, dims=1)]),
            "previous token's row": ref(x, table[IDS.roll(1, dims=1)]),
        }
    for name, out in wrong.items():
        assert not torch.allclose(ours, out, rtol=1e-2, atol=1e-3), name


def capture_ffns(model: StemForCausalLM) -> tuple[dict, list]:
    """Each layer's FFN input and output, and each layer's residual before the FFN and output, by forward hooks."""
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):

        def ffn(module, args, output, i=i):
            seen[i, "ffn"] = args[0], output

        def residual(module, args, output, i=i):
            seen[i, "h"] = args[0]

        def block(module, args, output, i=i):
            seen[i, "out"] = output[0] if isinstance(output, tuple) else output

        handles += [
            layer.mlp.register_forward_hook(ffn),
            layer.post_attention_layernorm.register_forward_hook(residual),
            layer.register_forward_hook(block),
        ]
    return seen, handles


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_layer_of_a_model_computes_the_reference_ffn(dtype):
    model = sensitive_model().to(dtype)  # layers 1 and 3 are STEM, 0 and 2 dense
    for table in model.model.stem_tables.values():
        table.to(dtype).weight.data.normal_()  # drawn in `dtype`: rows that a bf16 round trip would change
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    seen, handles = capture_ffns(model)
    with torch.no_grad():
        model(ids)
        for i, layer in enumerate(model.model.layers):
            x, out = seen[i, "ffn"]
            torch.testing.assert_close(x, layer.post_attention_layernorm(seen[i, "h"]))  # ffn(ffn_norm(h))
            torch.testing.assert_close(seen[i, "out"], seen[i, "h"] + out, **TOLERANCES[dtype])  # h + ffn(...)
            if i in model.config.stem_layers:
                ref = reference_stem_ffn(layer.mlp, dtype)
                table = model.model.stem_tables[str(i)].weight  # named model.stem_tables.<layer>.weight
                torch.testing.assert_close(out, ref(x, table[ids]), **TOLERANCES[dtype])
                assert not torch.allclose(out, ref(x, table[ids.roll(1, dims=1)]), rtol=1e-2, atol=1e-3)
            else:
                ref = ReferenceFeedForward(x.shape[-1], layer.mlp.up_proj.out_features).to(dtype)
                for name, ours in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                    getattr(ref, name).weight.copy_(getattr(layer.mlp, ours).weight)
                torch.testing.assert_close(out, ref(x), **TOLERANCES[dtype])
    for handle in handles:
        handle.remove()
    names = {n for n, _ in model.named_parameters() if "stem_tables" in n}
    assert names == {"model.stem_tables.1.weight", "model.stem_tables.3.weight"}
    assert not hasattr(model.model.layers[1].mlp, "up_proj") and model.config.mlp_bias is False


def test_tables_start_xavier_normal():
    """Reference init: xavier-normal over `[V, d_ff]`, std sqrt(2 / (V + d_ff)). With N = 2048 x 512 values the sample
    std has a relative standard error of 1 / sqrt(2N) = 7e-4, so 0.5% is 7 standard errors, while the nearest wrong
    stds (initializer_range 0.02, sqrt(1 / d_ff) = 0.044) are 28% and more away; the mean's standard error is
    std / sqrt(N); the kurtosis of a normal is 3 with standard error sqrt(24 / N) = 0.005, a uniform's 1.8."""
    torch.manual_seed(0)
    vocab, d_ff = 2048, 512
    config = StemConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=d_ff,
        num_hidden_layers=2,
        num_attention_heads=2,
        stem_layers="full",
        table_dtype="float32",
    )
    weight = StemForCausalLM(config).model.stem_tables["1"].weight.detach().double()
    std, n = math.sqrt(2 / (vocab + d_ff)), weight.numel()
    assert weight.std().item() == pytest.approx(std, rel=0.005)
    assert abs(weight.mean().item()) < 6 * std / math.sqrt(n)
    assert ((weight - weight.mean()) ** 4).mean().item() / weight.var().item() ** 2 == pytest.approx(3, abs=0.05)


def test_layer_selection_against_the_reference():
    """Never layer 0 for a ratio. The reference 1B ran 5 of 16 layers: our "1/3" is [1, 4, 7, 10, 13]; its other list
    [2, 6, 10, 14] (4 layers) is not a ratio here and is passed explicitly. Its 1/2 is the odd layers, as ours. Its
    350M list [2, 4, ..., 26] (13 of 32 layers) is none of our ratios ("1/2" of 32 is the 16 odd layers): explicit
    too. The reference default, every layer but 0, is our "full"."""
    for layers in (2, 3, 16, 24, 32):
        for ratio in ("1/3", "1/2", "full", "1/4"):
            assert 0 not in resolve_stem_layers(ratio, layers)
        assert resolve_stem_layers("full", layers) == list(range(1, layers))
    assert resolve_stem_layers("1/3", 16) == [1, 4, 7, 10, 13]
    assert resolve_stem_layers("1/2", 16) == list(range(1, 16, 2))
    assert resolve_stem_layers("1/2", 32) == list(range(1, 32, 2)) != list(range(2, 27, 2))
    assert len(resolve_stem_layers("1/3", 32)) == 11
    assert StemConfig(num_hidden_layers=16, stem_layers=[2, 6, 10, 14]).stem_layers == [2, 6, 10, 14]
    assert StemConfig(num_hidden_layers=32, stem_layers="2,4,6,8,10,12,14,16,18,20,22,24,26").stem_layers == list(
        range(2, 27, 2)
    )


# The paper's 350M: MobileLLM-350M's shape in the reference config.
PAPER_350M = dict(
    vocab_size=32000,
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    head_dim=64,
)


def test_the_paper_sizes_have_the_reference_hidden_dim():
    assert reference_hidden_dim(960) == PAPER_350M["intermediate_size"]
    assert reference_hidden_dim(2048, ffn_dim_multiplier=1.5) == PAPER_1B["intermediate_size"]  # Llama-3.2-1B's


def test_accounting_gives_the_paper_1b_counts():
    """Dense, untied: 1,498,482,688 = 1.50B. STEM on 5 layers drops 5 up-projections, 5 x 2048 x 8192 = 83,886,080,
    leaving 1,414,596,608 outside the tables; one token also reads 5 rows of 8192, so active is 1,414,637,568 = 1.41B.
    The tables are 5 x 128256 x 8192 = 5,253,365,760; our total 1,414,596,608 + 5,253,365,760 = 6,667,962,368
    (6.67B). The paper's 6.75B is the dense count plus the tables, 6,751,848,448: it keeps the removed
    up-projections. Only 5 STEM layers give 1.41B active (4: 1.43B, 6: 1.40B) and only untied embeddings give
    1.50B dense (tied: 1.24B)."""
    dense = summarize(StemConfig(**PAPER_1B, stem_layers=[]))
    assert dense["total_params"] == dense["dense_params"] == dense["active_params_per_token"] == 1_498_482_688
    stem = summarize(StemConfig(**PAPER_1B, stem_layers="1/3"))
    removed, tables = 5 * 2048 * 8192, 5 * 128256 * 8192
    assert (removed, tables) == (83_886_080, 5_253_365_760)
    assert stem["stem_layers"] == [1, 4, 7, 10, 13] and stem["table_params"] == tables
    assert stem["total_params"] - tables == 1_498_482_688 - removed == 1_414_596_608
    assert stem["active_params_per_token"] == 1_414_596_608 + 5 * 8192 == 1_414_637_568
    assert stem["total_params"] == 6_667_962_368 and stem["dense_params"] == 1_498_482_688
    assert stem["total_params"] + removed == dense["total_params"] + tables == 6_751_848_448
    assert round((stem["total_params"] + removed) / 1e9, 2) == 6.75
    for layers, active in (([2, 6, 10, 14], 1.43), ([1, 3, 5, 7, 9, 11], 1.40)):
        other = summarize(StemConfig(**PAPER_1B, stem_layers=layers))
        assert round(other["active_params_per_token"] / 1e9, 2) == active
    tied = summarize(StemConfig(**PAPER_1B, stem_layers=[], tie_word_embeddings=True))
    assert tied["total_params"] == 1_498_482_688 - 128256 * 2048 == 1_235_814_400


# Per STEM layer at 350M: a 32000 x 2560 table (81,920,000), no 960 x 2560 up-projection (2,457,600), a row of 2560.
TABLE_350M, UP_350M, ROW_350M = 81_920_000, 2_457_600, 2560
PAPER_350M_COUNTS = {"1/3": (1.14, 0.35), "1/2": (1.85, 0.34), "full": (3.25, 0.30)}  # total, active


def test_accounting_gives_the_paper_350m_active_counts_but_not_its_totals():
    """Dense: a layer holds 960 x (960 + 320 + 320 + 960) = 2,457,600 attention and 3 x 960 x 2560 = 7,372,800 FFN
    parameters and 2 x 960 norm weights, 9,832,320 in all; 32 layers are 314,634,240, plus the final norm 960 and the
    embedding 32000 x 960 = 30,720,000 once (tied: 345,355,200 = 0.35B) or twice (untied: 376,075,200 = 0.38B). The
    paper's 0.37B is the untied count cut, not rounded, to two decimals.

    Active, untied, with our ratios (11, 16 and 31 STEM layers): 376,075,200 - n x (2,457,600 - 2560) gives 349,069,760
    (0.35B), 336,794,560 (0.34B) and 299,968,960 (0.30B), the paper's three. Tied they are 0.32B, 0.31B and 0.27B.

    Totals do not reproduce: ours (dense - n up-projections + n tables) are 1.25B, 1.65B and 2.84B, and with the
    paper's 1B convention (dense + n tables) 1.28B, 1.69B and 2.92B, against the paper's 1.14B, 1.85B and 3.25B. The
    three are not even consistent with one table size: 1/2 and full imply ~92M per table (over 16 and 31 layers),
    1/3 ~69M over 11; see the next test."""
    untied = dict(PAPER_350M, tie_word_embeddings=False)
    dense = summarize(StemConfig(**untied, stem_layers=[]))["total_params"]
    assert dense == 376_075_200 and round(dense / 1e9, 3) == 0.376 and math.floor(dense / 1e7) / 100 == 0.37
    assert summarize(StemConfig(**PAPER_350M, tie_word_embeddings=True, stem_layers=[]))["total_params"] == 345_355_200
    expected = {"1/3": (11, 349_069_760, 1.25), "1/2": (16, 336_794_560, 1.65), "full": (31, 299_968_960, 2.84)}
    for ratio, (total, active) in PAPER_350M_COUNTS.items():
        s = summarize(StemConfig(**untied, stem_layers=ratio))
        n, exact_active, our_total = expected[ratio]
        assert len(s["stem_layers"]) == n and s["table_params"] == n * TABLE_350M
        assert s["active_params_per_token"] == dense - n * (UP_350M - ROW_350M) == exact_active
        assert round(s["active_params_per_token"] / 1e9, 2) == active
        assert s["total_params"] == dense - n * UP_350M + n * TABLE_350M
        assert round(s["total_params"] / 1e9, 2) == our_total != total
        assert round((dense + n * TABLE_350M) / 1e9, 2) != total


def test_no_350m_layer_count_or_tying_gives_a_paper_total_with_its_active_count():
    """The search behind the finding above: for tied and untied embeddings, any number of STEM layers 0..32, and
    either convention for the total, no choice gives the paper's total and active count of the same ratio together.
    The counts are linear in the number of STEM layers (checked against the accounting at 0 and 31)."""
    found = []
    for tied in (True, False):
        config = dict(PAPER_350M, tie_word_embeddings=tied)
        dense = summarize(StemConfig(**config, stem_layers=[]))["total_params"]
        full = summarize(StemConfig(**config, stem_layers="full"))
        assert full["total_params"] == dense + 31 * (TABLE_350M - UP_350M)
        for n in range(33):
            active = round((dense - n * (UP_350M - ROW_350M)) / 1e9, 2)
            totals = {round((dense + n * (TABLE_350M - UP_350M)) / 1e9, 2), round((dense + n * TABLE_350M) / 1e9, 2)}
            found += [(tied, n, r) for r, (t, a) in PAPER_350M_COUNTS.items() if active == a and t in totals]
    assert found == []
