"""`attnlab generate`: greedy equal to HF GPT2LMHeadModel.generate on an HF-written folder,
left-padded batches equal to one prompt at a time, seeds, streaming, --stop, --truncate-left,
and bad input (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.tasks.lm import generate_texts, load_lm
from attnlab.text.lm_tokenizer import train_byte_bpe

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 40
PROMPTS = ["Speak, speak.", "All", "Before we proceed any further, hear", "F"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def char_model(corpus) -> Path:
    """A tiny character-level GPT trained a few steps by `attnlab lm train`."""
    out = corpus.parent / "char"
    config = corpus.parent / "tiny.toml"
    config.write_text("[model_config]\nn_layers = 1\nd_model = 32\nn_heads = 2\nd_ff = 64\n"
                      "max_positions = 48\n")  # fmt: skip
    args = ["lm", "train", "--corpus", corpus, "--out", out, "--config", config, "--steps", 30,
            "--seq-len", 24, "--batch-size", 8, "--lr", "3e-3", "--eval-every", 0,
            "--cache-dir", corpus.parent / "cache", "--no-progress"]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    return out


@pytest.fixture(scope="module")
def hf_model(corpus) -> Path:
    """A random GPT2LMHeadModel and a GPT2TokenizerFast, as HF's save_pretrained writes them."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    tokenizer_dir = corpus.parent / "bpe"
    train_byte_bpe([corpus], 300).save(tokenizer_dir)
    tokenizer = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    out = corpus.parent / "hf"
    GPT2LMHeadModel(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def run(capsys, *args: object) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_greedy_equals_hf_generate_token_for_token(hf_model, capsys):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    hf = GPT2LMHeadModel.from_pretrained(str(hf_model)).eval()
    tokenizer = GPT2TokenizerFast.from_pretrained(str(hf_model))
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        new = hf.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1] :].tolist()  # fmt: skip
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        code, out, err = run(capsys, "generate", "--model", hf_model, prompt, "--greedy",
                             "--max-new-tokens", 20)  # fmt: skip
        assert code == 0, err
        assert out == prompt + tokenizer.decode(new) + "\n"


def test_left_padded_batches_equal_one_prompt_at_a_time(hf_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    outputs = []
    for batch in (1, 4):
        code, out, err = run(capsys, "generate", "--model", hf_model, "--input", prompts, "--greedy",
                             "--max-new-tokens", 12, "--batch-size", batch)  # fmt: skip
        assert code == 0, err
        outputs.append([json.loads(line) for line in out.splitlines()])
    assert outputs[0] == outputs[1]
    assert [row["prompt"] for row in outputs[0]] == PROMPTS


def test_sampling_is_reproducible_by_seed_and_samples_repeat_each_prompt(
    char_model, tmp_path, capsys
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("All\nSpeak\n")
    args = ["generate", "--model", char_model, "--input", prompts, "--max-new-tokens", 16]
    args += ["--num-samples", 3, "--top-k", 5, "--top-p", "0.9", "--temperature", "0.8"]
    first = run(capsys, *args, "--seed", 7)
    assert first[0] == 0, first[2]
    rows = [json.loads(line) for line in first[1].splitlines()]
    assert [r["prompt"] for r in rows] == ["All"] * 3 + ["Speak"] * 3
    assert all(len(r["completion"]) == 16 for r in rows)  # characters: one token each
    assert run(capsys, *args, "--seed", 7)[1] == first[1]
    assert run(capsys, *args, "--seed", 8)[1] != first[1]
    streamed = run(capsys, "generate", "--model", char_model, "All", "--seed", 3,
                   "--max-new-tokens", 10, "--num-samples", 2)  # fmt: skip
    assert streamed[0] == 0 and [len(line) for line in streamed[1].split("\n")[:-1]] != []


def test_streaming_hands_out_each_token_as_it_is_made(char_model):
    model, tokenizer = load_lm(char_model)
    pieces: list[str] = []
    [(_, completion)] = generate_texts(model, tokenizer, ["All"], max_new_tokens=12, greedy=True,
                                       on_text=pieces.append)  # fmt: skip
    assert len(pieces) == 12 and "".join(pieces) == completion


def test_stop_text_ends_a_sample_before_it(char_model, tmp_path, capsys):
    model, tokenizer = load_lm(char_model)
    [(_, full)] = generate_texts(model, tokenizer, ["All"], max_new_tokens=20, greedy=True)
    stop = full[3:5]
    code, out, err = run(capsys, "generate", "--model", char_model, "All", "--greedy",
                         "--max-new-tokens", 20, "--stop", stop)  # fmt: skip
    assert code == 0, err
    assert out == "All" + full.split(stop, 1)[0] + "\n"
    [(_, cut)] = generate_texts(
        model, tokenizer, ["All"], max_new_tokens=20, greedy=True, stop=stop
    )
    assert cut == full.split(stop, 1)[0]


def test_a_prompt_past_the_context_needs_truncate_left(char_model, capsys):
    long = "Speak, speak. " * 5  # 70 characters; context 48
    code, out, err = run(capsys, "generate", "--model", char_model, long, "--greedy",
                         "--max-new-tokens", 8)  # fmt: skip
    assert code == 2 and out == "" and "--truncate-left" in err and err.count("\n") == 1
    code, out, err = run(capsys, "generate", "--model", char_model, long, "--greedy",
                         "--max-new-tokens", 8, "--truncate-left")  # fmt: skip
    assert code == 0, err
    model, tokenizer = load_lm(char_model)
    [(_, tail)] = generate_texts(model, tokenizer, [long[-40:]], max_new_tokens=8, greedy=True)
    assert out == long + tail + "\n"  # the prompt's last 48 - 8 characters were its context


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--greedy", "--temperature", "0.5"], "--greedy takes the most likely token"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    ],
)
def test_bad_options_are_one_line(char_model, capsys, flags, message):
    code, out, err = run(capsys, "generate", "--model", char_model, "All", *flags)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_unknown_characters_and_other_models_are_refused(char_model, minilm_dir, capsys):
    code, out, err = run(
        capsys, "generate", "--model", char_model, "Zq7 All", "--max-new-tokens", 4
    )
    assert code == 2 and out == "" and "'Z', 'q', '7'" in err and err.count("\n") == 1
    code, out, err = run(capsys, "generate", "--model", minilm_dir, "hello")
    assert code == 2 and "is not a GPT language model" in err and err.count("\n") == 1
