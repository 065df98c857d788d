"""The pictures: attention heatmaps and positional-encoding plots are PNGs of the figure's size
with ink on them, Chinese tokens are drawn with a font that has their glyphs, and the numbers
the position plots draw have the properties the notes claim (checked against the formulas)."""

from __future__ import annotations

import json
import math
import struct
import warnings
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.errors import AttnlabError
from attnlab.inspect.heatmap import cjk_font, grid_heatmap, head_heatmap
from attnlab.inspect.positions_plot import (
    SCHEMES,
    PositionsPlot,
    additive_table,
    dot_by_distance,
    offset_cosine,
    resolve,
    shaw_tables,
)
from attnlab.nn import positions as pe

pytestmark = pytest.mark.usefixtures("one_thread")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def ink(path: Path) -> float:
    """Share of pixels that are not white."""
    import matplotlib.image

    pixels = matplotlib.image.imread(path)[..., :3]
    return float((pixels.min(-1) < 0.9).mean())


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_cjk_font_is_found_and_chinese_tokens_draw_without_missing_glyphs(tmp_path):
    assert cjk_font() is not None, "install a CJK font (make test installs fonts-noto-cjk)"
    tokens = [*"我们吃苹果", "[SEP]"]
    weights = torch.rand(len(tokens), len(tokens)).softmax(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)"
        head_heatmap(weights, tokens, tokens, "苹果", tmp_path / "zh.png")
    width, height = png_size(tmp_path / "zh.png")
    assert (width, height) == (550, 500)  # figsize (4 + 1.5, 4 + 1) inches at 100 dpi
    assert 0.05 < ink(tmp_path / "zh.png") < 0.95


def test_attention_pngs_from_the_cli(minilm_dir, tmp_path, capsys):
    text = "The river bank was muddy."
    for name, flags in [
        ("head.png", ["--layer", "2", "--head", "3"]),
        ("layer.png", ["--layer", "2"]),
        ("model.png", ["--heads", "0-3"]),
    ]:
        out = tmp_path / name
        code, stdout, err = run_cli(capsys, "attention", "--model", minilm_dir, text,
                                    "--out", out, *flags)  # fmt: skip
        assert code == 0, err
        summary = json.loads(stdout)
        assert summary["kind"] == "encoder"
        width, height = png_size(out)
        assert width > 300 and height > 300 and ink(out) > 0.05
    assert json.loads(stdout)["layers"] == [0, 1, 2, 3, 4, 5]


def test_grid_of_heads_has_one_cell_per_head(tmp_path):
    weights = torch.rand(1, 9, 5, 5).softmax(-1)
    grid_heatmap(weights, list("abcde"), list("abcde"), ["L0"], [f"h{i}" for i in range(9)],
                 "grid", tmp_path / "g.png")  # fmt: skip
    # 9 heads wrap into 3 x 3 cells of 3.2 inches, plus margins, at 100 dpi.
    assert png_size(tmp_path / "g.png") == (3 * 320 + 150, 3 * 320 + 100)


# --- positional encodings ----------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_plots(scheme, tmp_path, capsys):
    out = tmp_path / f"{scheme}.png"
    code, stdout, err = run_cli(capsys, "plot", "positions", "--scheme", scheme, "--out", out,
                                "--positions", "64", "--dim", "32")  # fmt: skip
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["scheme"] == scheme and len(summary["panels"]) == 3
    assert png_size(out) == (1530, 560)  # three 4.6-inch panels plus margins at 100 dpi
    assert ink(out) > 0.05


def test_sinusoidal_dot_product_depends_on_the_distance_only():
    n, d = 96, 64
    table = additive_table("sinusoidal", pe.SinusoidalPositions(d, n), n)
    # The formula: PE(p).PE(p+k) = sum_i cos(k * w_i), with w_i = 10000^(-2i/d).
    w = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    by_formula = torch.cos(torch.arange(n, dtype=torch.float64)[:, None] * w).sum(-1)
    for p, dots in dot_by_distance(table, [0, 10, 40]).items():
        torch.testing.assert_close(dots.double(), by_formula[: n - p], atol=1e-4, rtol=0)


def test_integer_and_normalized_dot_products_depend_on_the_start():
    n, d = 64, 16
    for scheme, encoding in (("integer", pe.IntegerPositions(d)),
                             ("normalized", pe.NormalizedPositions(d))):  # fmt: skip
        table = additive_table(scheme, encoding, n)
        dots = dot_by_distance(table, [1, 20])
        assert not torch.allclose(dots[1][:10], dots[20][:10])  # same k, another p
    integer = additive_table("integer", pe.IntegerPositions(d), n)
    assert float(integer[n - 1].norm()) == pytest.approx(n * math.sqrt(d))  # |(n, -n, ...)|


def test_rope_scores_depend_on_the_offset_only():
    from attnlab.nn.attention import rotate_half

    rope = pe.RotaryPositions(16)
    cos, sin = rope.rotary(torch.arange(40))
    q, k = torch.randn(16), torch.randn(16)
    rq, rk = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    torch.testing.assert_close(rk[5:25] @ rq[5], rk[15:35] @ rq[15], atol=1e-4, rtol=0)


def test_alibi_bias_is_minus_slope_times_distance():
    alibi = pe.ALiBi(8)
    bias = alibi.attention_bias(torch.arange(6), torch.arange(6))[0]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 8) for h in range(8)])
    distance = (torch.arange(6)[None, :] - torch.arange(6)[:, None]).abs()
    torch.testing.assert_close(bias, -slopes[:, None, None] * distance)


def test_a_models_trained_table_is_drawn(minilm_dir, tmp_path, capsys):
    scheme, encoding, d_model, n, _ = resolve(PositionsPlot(model=minilm_dir, positions=512))
    assert (scheme, d_model, n) == ("learned", 384, 512)
    hf = __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(minilm_dir / "model.safetensors")
    )
    table = hf.get("embeddings.position_embeddings.weight")
    if table is None:
        table = hf["bert.embeddings.position_embeddings.weight"]
    torch.testing.assert_close(additive_table(scheme, encoding, n), table.float())
    out = tmp_path / "minilm.png"
    code, stdout, err = run_cli(capsys, "plot", "positions", "--model", minilm_dir, "--out", out)
    assert code == 0, err
    assert json.loads(stdout)["scheme"] == "learned"
    assert ink(out) > 0.05


def test_bad_position_requests_are_one_line(minilm_dir, tmp_path, capsys):
    out = tmp_path / "p.png"
    for flags, fragment in [
        (["--scheme", "rope", "--model", minilm_dir], "uses learned, not rope"),
        (["--dim", "7", "--scheme", "sinusoidal"], "--dim must be even"),
        (["--positions", "1", "--scheme", "sinusoidal"], "--positions must be from 4"),
        ([], "give a --scheme or a --model"),
        (["--scheme", "shaw", "--model", minilm_dir], "uses learned, not shaw"),
        (["--scheme", "rope", "--layer", "1"], "--layer is for shaw only"),
        (["--model", minilm_dir, "--layer", "0"], "leave --layer out"),
    ]:
        code, _, err = run_cli(capsys, "plot", "positions", "--out", out, *flags)
        assert code == 2 and err.count("\n") == 1 and fragment in err, err
    with pytest.raises(AttnlabError, match="scheme must be one of"):
        resolve(PositionsPlot(scheme="xpos"))
    assert not out.exists()


@pytest.fixture(scope="module")
def shaw_gpt_dir(tmp_path_factory) -> Path:
    """A 3-layer Shaw GPT folder (k = 4, w^K and w^V) whose tables are far from their init."""
    from attnlab.config import GPTConfig
    from attnlab.interop.gpt2 import save_gpt
    from attnlab.models.gpt import GPT
    from attnlab.text.lm_tokenizer import char_tokenizer

    torch.manual_seed(0)
    config = GPTConfig.preset(
        "gpt-char", vocab_size=30, n_layers=3, d_model=32, n_heads=4, d_ff=64,
        position_encoding="shaw", shaw_max_distance=4,
    )  # fmt: skip
    model = GPT(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, pe.RelativePositionRepresentations):
                module.keys.normal_()
                module.values.normal_()
    root = tmp_path_factory.mktemp("shaw-gpt")
    save_gpt(model, root)
    char_tokenizer("abcdefghij").save(root)
    return root


def test_a_shaw_models_drawn_tables_are_its_saved_parameters(shaw_gpt_dir, tmp_path, capsys):
    import matplotlib.pyplot as plt
    from safetensors.torch import load_file

    from attnlab.inspect.heatmap import _figure
    from attnlab.inspect.positions_plot import _draw_shaw

    saved = load_file(str(shaw_gpt_dir / "model.safetensors"))  # read apart from the model code
    for layer in (None, 2):
        scheme, encoding, d_model, n, note = resolve(PositionsPlot(model=shaw_gpt_dir, layer=layer))
        index = layer or 0
        assert (scheme, d_model, n) == ("shaw", 32, 9) and f"layer {index} of 3" in note
        keys, values = shaw_tables(encoding)
        prefix = f"layers.{index}.self_attn.relative"
        torch.testing.assert_close(keys, saved[f"{prefix}.keys"], rtol=0, atol=0)
        torch.testing.assert_close(values, saved[f"{prefix}.values"], rtol=0, atol=0)
        fig, axes = _figure(1, 3, cell=4.6)
        _draw_shaw(axes[0], encoding)  # the arrays the heatmaps show
        shown = [torch.as_tensor(ax.images[0].get_array().data) for ax in axes[0]]
        torch.testing.assert_close(shown[0], saved[f"{prefix}.keys"], rtol=0, atol=0)
        torch.testing.assert_close(shown[2], saved[f"{prefix}.values"], rtol=0, atol=0)
        unit = saved[f"{prefix}.keys"] / saved[f"{prefix}.keys"].norm(dim=-1, keepdim=True)
        torch.testing.assert_close(shown[1], unit @ unit.T, atol=1e-5, rtol=0)
        plt.close(fig)
    out = tmp_path / "shaw.png"
    code, stdout, err = run_cli(capsys, "plot", "positions", "--model", shaw_gpt_dir,
                                "--layer", "1", "--out", out)  # fmt: skip
    assert code == 0, err
    summary = json.loads(stdout)
    assert (summary["scheme"], summary["offsets"], summary["max_distance"]) == ("shaw", 9, 4)
    assert png_size(out) == (1530, 560) and ink(out) > 0.05
    code, _, err = run_cli(capsys, "plot", "positions", "--model", shaw_gpt_dir, "--layer", "3",
                           "--out", tmp_path / "no.png")  # fmt: skip
    assert code == 2 and "3 self-attention layers: --layer must be from 0 to 2" in err, err


def test_offset_cosine_is_symmetric_with_ones_on_its_diagonal():
    torch.manual_seed(0)
    table = torch.randn(9, 16) * torch.rand(9, 1) * 5  # rows of different lengths
    cosine = offset_cosine(table)
    torch.testing.assert_close(cosine, cosine.T)
    torch.testing.assert_close(cosine.diagonal(), torch.ones(9))
    by_formula = torch.nn.functional.cosine_similarity(table[:, None], table[None], dim=-1)
    torch.testing.assert_close(cosine, by_formula, atol=1e-6, rtol=0)


def test_shaw_without_values_draws_the_key_norms():
    import matplotlib.pyplot as plt

    from attnlab.inspect.heatmap import _figure
    from attnlab.inspect.positions_plot import _draw_shaw

    tables = pe.RelativePositionRepresentations(8, 3, values=False)
    fig, axes = _figure(1, 3, cell=4.6)
    _draw_shaw(axes[0], tables)
    offsets, norms = axes[0][2].lines[0].get_data()
    assert list(offsets) == [-3, -2, -1, 0, 1, 2, 3]
    torch.testing.assert_close(torch.as_tensor(norms), tables.keys.detach().norm(dim=-1))
    plt.close(fig)


# --- contextual embeddings ---------------------------------------------------------------------


def test_contextual_cosines_equal_hf_hidden_states(minilm_dir):
    from transformers import BertModel as HFBertModel
    from transformers import BertTokenizerFast

    from attnlab.inspect.contextual import contextual_similarity
    from attnlab.inspect.maps import load_attention_model

    model, tokenizer = load_attention_model(minilm_dir)
    a, b = "We sat on the river bank.", "I took a loan from the bank."
    pair = contextual_similarity(model, tokenizer, "bank", a, b)
    hf, hf_tok = (
        HFBertModel.from_pretrained(str(minilm_dir)),
        BertTokenizerFast.from_pretrained(str(minilm_dir)),
    )
    vectors = []
    for text in (a, b):
        batch = hf_tok(text, return_tensors="pt")
        where = hf_tok.convert_ids_to_tokens(batch["input_ids"][0]).index("bank")
        with torch.no_grad():
            states = hf(**batch, output_hidden_states=True).hidden_states
        vectors.append(torch.stack([h[0, where] for h in states]))
    expected = torch.nn.functional.cosine_similarity(*vectors, dim=-1)
    torch.testing.assert_close(torch.tensor(pair.cosines), expected, atol=1e-5, rtol=0)
    assert len(pair.cosines) == 7 and pair.cosines[-1] < pair.cosines[0]
    same = contextual_similarity(model, tokenizer, "bank", a, a)
    torch.testing.assert_close(torch.tensor(same.cosines), torch.ones(7))


def test_plot_contextual_cli(minilm_dir, tmp_path, capsys):
    out = tmp_path / "ctx.png"
    code, stdout, err = run_cli(capsys, "plot", "contextual", "--model", minilm_dir, "--out", out)
    assert code == 0, err
    summary = json.loads(stdout)
    assert list(summary["cosines"]) == ["bank"] and "skipped 苹果" in err  # no 苹 in MiniLM
    assert png_size(out) == (650, 600) and ink(out) > 0.02
    code, _, err = run_cli(capsys, "plot", "contextual", "--model", minilm_dir, "--out",
                           tmp_path / "x.png", "--example", "cat", "a dog", "a cat")  # fmt: skip
    assert code == 2 and "'cat' is not among the tokens of 'a dog'" in err
