"""attention_maps: BERT's weights equal HF's output_attentions on the real MiniLM checkpoint;
the translation model's encoder, decoder and cross weights equal eq. (1) recomputed by hand
from each attention module's inputs; bad input is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from attnlab.config import TransformerConfig
from attnlab.errors import AttnlabError
from attnlab.inspect.maps import AttentionMaps, attention_maps, load_attention_model
from attnlab.models.seq2seq import Transformer
from attnlab.nn.attention import MultiHeadAttention

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["The cat sat on the mat.", "今天天气很好，我们去公园散步吧。"]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    model, tokenizer = load_attention_model(minilm_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def hf_minilm(minilm_dir):
    """HF's BertModel with eager attention: its SDPA path returns no weights."""
    from transformers import BertModel as HFBertModel

    return HFBertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()


def _hf_attentions(hf_minilm, hf_tokenizer, text, pair=None):
    batch = hf_tokenizer(text, pair, return_tensors="pt")
    with torch.no_grad():
        out = hf_minilm(**batch, output_attentions=True)
    tokens = hf_tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    return torch.stack([a[0] for a in out.attentions]), tokens, batch["token_type_ids"][0]


@pytest.mark.parametrize("text", SENTENCES)
def test_bert_weights_equal_hf_output_attentions(minilm, hf_minilm, hf_tokenizer, text):
    maps = attention_maps(*minilm, text)
    expected, tokens, _ = _hf_attentions(hf_minilm, hf_tokenizer, text)
    assert maps.tokens == tokens
    assert maps.pair_tokens is None and maps.target_tokens is None
    assert maps.decoder is None and maps.cross is None
    assert maps.encoder.shape == expected.shape == (6, 12, len(tokens), len(tokens))
    torch.testing.assert_close(maps.encoder, expected, atol=1e-5, rtol=0)


def test_bert_pair_weights_and_segment_b_tokens(minilm, hf_minilm, hf_tokenizer):
    a, b = "A man is playing a guitar.", "Someone plays an instrument."
    maps = attention_maps(*minilm, a, pair=b)
    expected, tokens, types = _hf_attentions(hf_minilm, hf_tokenizer, a, b)
    assert maps.tokens == tokens
    assert maps.pair_tokens == [t for t, s in zip(tokens, types.tolist(), strict=True) if s]
    assert maps.pair_tokens[-1] == "[SEP]" and tokens[-len(maps.pair_tokens) - 1] == "[SEP]"
    torch.testing.assert_close(maps.encoder, expected, atol=1e-5, rtol=0)


def test_a_task_models_weights_are_its_encoders(minilm_dir, hf_minilm, hf_tokenizer, minilm):
    from attnlab.interop.hf import load_task_model

    model, fresh = load_task_model(minilm_dir, "classify", num_labels=3, new_head=True)
    assert "classifier" in fresh
    maps = attention_maps(model, minilm[1], SENTENCES[0])
    expected, _, _ = _hf_attentions(hf_minilm, hf_tokenizer, SENTENCES[0])
    torch.testing.assert_close(maps.encoder, expected, atol=1e-5, rtol=0)


def test_bert_long_input_needs_truncate(minilm):
    model, tokenizer = minilm
    text = "word " * 600
    with pytest.raises(AttnlabError, match=r"at most 512.*truncate"):
        attention_maps(model, tokenizer, text)
    maps = attention_maps(model, tokenizer, text, truncate=True)
    assert maps.encoder.shape[-1] == len(maps.tokens) == 512
    assert maps.tokens[-1] == "[SEP]"


# --- the translation Transformer ------------------------------------------------------------


def make_translation_dir(root: Path, seed: int = 0, **overrides) -> Path:
    """A small random translation model directory, as `attnlab translate train` writes one."""
    from attnlab.tasks.translate import bundled_pairs, save_model_dir
    from attnlab.text.bpe import train_bpe_from_texts

    lines = bundled_pairs().read_text(encoding="utf-8").splitlines()
    texts = [side for line in lines for side in line.split("\t")]
    tokenizer = train_bpe_from_texts(texts, vocab_size=300)
    args = dict(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=3,
                max_positions=64)  # fmt: skip
    args.update(overrides)
    size = tokenizer.vocab_size
    config = TransformerConfig(src_vocab_size=size, tgt_vocab_size=size, **args)
    torch.manual_seed(seed)
    save_model_dir(root, config, tokenizer, Transformer(config))
    return root


@pytest.fixture(scope="module")
def translation(tmp_path_factory):
    return load_attention_model(make_translation_dir(tmp_path_factory.mktemp("mt")))


def _by_formula(model: Transformer, call) -> dict[str, list[torch.Tensor]]:
    """Each attention module's weights, recomputed from its inputs: softmax(q k^T / sqrt(d) + mask)."""
    found: dict[str, list[torch.Tensor]] = {"encoder": [], "decoder": [], "cross": []}

    def hook(kind):
        def record(module: MultiHeadAttention, args, kwargs, _output):
            x = args[0]
            d, h = module.d_model, module.n_heads
            if module.cross:
                memory = args[1] if len(args) > 1 else kwargs["memory"]
                q = x @ module.q_proj.weight.T + module.q_proj.bias
                k = (memory @ module.kv_proj.weight.T + module.kv_proj.bias)[..., :d]
            else:
                qkv = x @ module.qkv_proj.weight.T + module.qkv_proj.bias
                q, k = qkv[..., :d], qkv[..., d : 2 * d]
            q = q.view(*q.shape[:2], h, d // h).transpose(1, 2)
            k = k.view(*k.shape[:2], h, d // h).transpose(1, 2)
            scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
            if kwargs.get("causal"):
                n = scores.shape[-1]
                scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            found[kind].append(scores.softmax(-1)[0])

        return record

    handles = []
    for layer in model.encoder.layers:
        handles.append(layer.self_attn.register_forward_hook(hook("encoder"), with_kwargs=True))
    for layer in model.decoder.layers:
        handles.append(layer.self_attn.register_forward_hook(hook("decoder"), with_kwargs=True))
        handles.append(layer.cross_attn.register_forward_hook(hook("cross"), with_kwargs=True))
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return {kind: torch.stack(ws) for kind, ws in found.items()}


def test_translation_weights_equal_the_formula_on_each_modules_inputs(translation):
    model, tokenizer = translation
    text, target = "ein Mann fährt Fahrrad.", "a man rides a bike."
    maps = attention_maps(model, tokenizer, text, target=target)
    src = [*tokenizer.encode(text), tokenizer.eos_id]
    tgt_in = [model.config.bos_id, *tokenizer.encode(target)]
    assert maps.tokens == [tokenizer.backend.id_to_token(i) for i in src]
    assert maps.target_tokens == ["<sos>", *tokenizer.tokenize(target)]
    with torch.no_grad():
        expected = _by_formula(model, lambda: model(torch.tensor([src]), torch.tensor([tgt_in])))
    s, t = len(src), len(tgt_in)
    assert maps.encoder.shape == (2, 4, s, s)
    assert maps.decoder.shape == (3, 4, t, t)
    assert maps.cross.shape == (3, 4, t, s)
    for kind in ("encoder", "decoder", "cross"):
        torch.testing.assert_close(getattr(maps, kind), expected[kind], atol=1e-6, rtol=1e-5)
    assert torch.all(maps.decoder.triu(1) == 0)  # the decoder never looks ahead


def test_translation_target_defaults_to_the_greedy_translation(translation):
    from attnlab.decode.search import greedy_search

    model, tokenizer = translation
    text = "zwei Hunde spielen im Schnee."
    src = torch.tensor([[*tokenizer.encode(text), tokenizer.eos_id]])
    output = greedy_search(model, src)[0]
    maps = attention_maps(model, tokenizer, text)
    assert maps.target_tokens == ["<sos>", *(tokenizer.backend.id_to_token(i) for i in output)]
    assert maps.query_tokens("cross") == maps.target_tokens
    assert maps.key_tokens("cross") == maps.tokens == maps.query_tokens("encoder")
    assert maps.key_tokens("decoder") == maps.target_tokens
    for weights in maps.kinds().values():
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


def test_to_json_has_the_issues_layout(translation):
    maps = attention_maps(*translation, "ein Hund.", target="a dog.")
    data = maps.to_json()
    assert set(data) == {"tokens", "target_tokens", "attention"}
    assert set(data["attention"]) == {"encoder", "decoder", "cross"}
    cross = data["attention"]["cross"]
    assert len(cross) == 3 and len(cross[0]) == 4
    assert len(cross[0][0]) == len(data["target_tokens"])
    assert len(cross[0][0][0]) == len(data["tokens"])


def test_bad_input_is_refused(translation, minilm, tmp_path):
    model, tokenizer = translation
    with pytest.raises(AttnlabError, match=r"the source has .* at most 64"):
        attention_maps(model, tokenizer, "ein Mann " * 80)
    maps = attention_maps(model, tokenizer, "ein Mann " * 80, target="a", truncate=True)
    assert len(maps.tokens) == 64 and maps.tokens[-1] == "<eos>"
    with pytest.raises(AttnlabError, match="the target has"):
        attention_maps(model, tokenizer, "ein Mann", target="a man " * 80)
    with pytest.raises(AttnlabError, match="pair is for BERT"):
        attention_maps(model, tokenizer, "ein Mann", pair="x")
    with pytest.raises(AttnlabError, match="target is for translation"):
        attention_maps(*minilm, "a man", target="x")
    with pytest.raises(AttnlabError, match="empty"):
        attention_maps(model, tokenizer, "  ")
    with pytest.raises(AttnlabError, match="no attention weights"):
        attention_maps(torch.nn.Linear(2, 2), tokenizer, "x")
    with pytest.raises(AttnlabError, match=r"no config.json"):
        load_attention_model(tmp_path)
    with pytest.raises(AttnlabError, match="does not exist"):
        load_attention_model(tmp_path / "missing")


def test_attention_maps_is_a_dataclass_of_tensors():
    maps = AttentionMaps(["a", "b"], encoder=torch.full((1, 1, 2, 2), 0.5))
    assert list(maps.kinds()) == ["encoder"]
    assert maps.to_json()["attention"]["encoder"] == [[[[0.5, 0.5], [0.5, 0.5]]]]


# --- the decoder-only LM ------------------------------------------------------------------------


def test_gpt_weights_equal_hf_gpt2_output_attentions(tmp_path):
    import transformers

    from attnlab.interop.gpt2 import load_gpt
    from attnlab.text.lm_tokenizer import char_tokenizer

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, attn_implementation="eager")  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    model = load_gpt(tmp_path)
    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz .")
    text = "the cat sat."
    maps = attention_maps(model, tokenizer, text)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        expected = torch.stack([a[0] for a in hf(ids, output_attentions=True).attentions])
    assert maps.tokens == list(text) and maps.encoder is None and maps.cross is None
    assert maps.query_tokens("decoder") == maps.key_tokens("decoder") == list(text)
    torch.testing.assert_close(maps.decoder, expected, atol=1e-5, rtol=0)
    with pytest.raises(AttnlabError, match="at most 32"):
        attention_maps(model, tokenizer, "a" * 33)
    assert attention_maps(model, tokenizer, "a" * 33, truncate=True).decoder.shape[-1] == 32
    with pytest.raises(AttnlabError, match="no pair or target"):
        attention_maps(model, tokenizer, text, pair="x")
