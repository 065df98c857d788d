"""The served model behind each kind of folder, and the batch each endpoint runs on it.

``load_served`` reads a model folder and picks its kind: a GPT (HF GPT-2's or attnlab's), a
translation model (config.json model_type attnlab-transformer), a fine-tuned BERT (a task head in config.json), or a BERT
encoder (with its masked-LM head when the weights hold one). Each kind's ``run`` is what
the batcher calls in its worker thread: the library functions the CLI calls, on a batch of
inputs gathered from several requests, so a served answer equals the CLI's.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from attnlab import fast
from attnlab.errors import AttnlabError


class EncoderModel:
    """A BERT: sentence embeddings (tasks/embed.py) and, with its MLM head, fill-mask."""

    kind = "bert"

    def __init__(self, model_dir: Path, pooling: str = "mean") -> None:
        from attnlab.interop.hf import (
            check_vocabulary,
            load_bert,
            read_config,
            sentence_max_length,
            weight_names,
        )
        from attnlab.text.tokenizer import BertTokenizer

        config = read_config(model_dir)
        self.tokenizer = BertTokenizer.from_dir(model_dir)
        check_vocabulary(model_dir, self.tokenizer.vocab_size, config)
        self.has_mlm = any(n.startswith("cls.predictions") for n in weight_names(model_dir))
        self.model = fast.for_serving(
            load_bert(model_dir, heads=self.has_mlm, trained_heads=self.has_mlm)
        )
        self.pooling = pooling
        self.max_positions = config.max_positions
        # As `attnlab embed`: a sentence-transformers folder's own length, else the model's.
        self.max_length = min(sentence_max_length(model_dir) or config.max_positions,
                              config.max_positions)  # fmt: skip

    def endpoints(self) -> list[str]:
        """The task endpoints this model answers."""
        return ["/v1/embeddings", "/v1/fill-mask"] if self.has_mlm else ["/v1/embeddings"]

    def token_count(self, text: str) -> int:
        """Tokens of text with [CLS] and [SEP], before any truncation."""
        return len(self.tokenizer.tokenize(text)) + 2

    def run(self, key: Hashable, texts: list[str]) -> list[Any]:
        """("embed", normalize): vectors as lists; ("fill-mask", top_k): fill_mask's lists."""
        import torch

        from attnlab.tasks.embed import embed
        from attnlab.tasks.pretrain import fill_mask

        op, option = key  # type: ignore[misc]
        if op == "embed":
            vectors = embed(self.model, self.tokenizer, texts, pooling=self.pooling,
                            normalize=option, max_length=self.max_length)  # fmt: skip
            return torch.stack(vectors).tolist() if vectors else []  # one copy, one conversion
        return [fill_mask(self.model, self.tokenizer, text, top_k=option) for text in texts]


class TaskModel:
    """A fine-tuned BERT (classify, regress, ner or qa), predicting as `attnlab predict`."""

    kind = "finetuned"

    def __init__(self, model_dir: Path) -> None:
        from attnlab.tasks.finetune.inference import load_finetuned

        self.loaded = load_finetuned(model_dir)
        self.model = fast.for_serving(self.loaded.model)
        self.task = self.loaded.task.name
        self.tokenizer = self.loaded.tokenizer
        self.max_length = self.loaded.settings.max_length

    def endpoints(self) -> list[str]:
        """The task endpoints this model answers (a regression head answers /v1/classify)."""
        return ["/v1/" + {"regress": "classify"}.get(self.task, self.task)]

    def token_count(self, item: Any) -> int:
        """Tokens of one input with its special tokens, before any truncation."""
        tokenize = self.tokenizer.tokenize
        if self.task == "ner":
            return sum(len(tokenize(word)) for word in item) + 2
        if isinstance(item, tuple):  # a pair, or a question and its context
            return len(tokenize(item[0])) + len(tokenize(item[1])) + 3
        return len(tokenize(item)) + 2

    def run(self, key: Hashable, items: list[Any]) -> list[dict[str, Any]]:
        """FinetunedModel.predict's rows: one per input, as predict_file writes them."""
        return self.loaded.predict(items)


class TranslationModel:
    """A Transformer translation model, translating as `attnlab translate`."""

    kind = "translation"

    def __init__(self, model_dir: Path) -> None:
        from attnlab.tasks.translate import load_translation_model

        self.model, self.tokenizer = load_translation_model(model_dir)
        fast.for_serving(self.model)
        self.max_length = self.model.config.max_positions

    def endpoints(self) -> list[str]:
        """The task endpoints this model answers."""
        return ["/v1/translate"]

    def token_count(self, line: str) -> int:
        """Source tokens of line with its <eos>, before any truncation."""
        return len(self.tokenizer.encode(line.strip())) + 1

    def run(self, key: Hashable, lines: list[str]) -> list[str]:
        """(beam, length_penalty, max_len_a, max_len_b): translate_lines' output."""
        from attnlab.tasks.translate import translate_lines

        beam, length_penalty, max_len_a, max_len_b = key  # type: ignore[misc]
        return translate_lines(self.model, self.tokenizer, lines, beam=beam,
                               length_penalty=length_penalty, max_len_a=max_len_a,
                               max_len_b=max_len_b)  # fmt: skip


class LanguageModel:
    """A decoder-only GPT, continuing prompts as `attnlab generate` (tasks/lm.py)."""

    kind = "gpt"

    def __init__(self, model_dir: Path) -> None:
        from attnlab.tasks.lm import load_lm

        self.model, self.tokenizer = load_lm(model_dir)  # plain: generation runs it so
        self.max_length = self.model.config.max_positions

    def endpoints(self) -> list[str]:
        """The task endpoints this model answers."""
        return ["/v1/completions"]

    def token_count(self, prompt: Any) -> int:
        """Tokens of a prompt (a prompt and its stream sink when streamed)."""
        text = prompt[0] if isinstance(prompt, tuple) else prompt
        return max(1, len(self.tokenizer.encode(text)))

    def completion_tokens(self, text: str) -> int:
        """Tokens of a generated text, as the tokenizer reads it back."""
        return len(self.tokenizer.encode(text))

    def run(self, key: Hashable, prompts: list[Any]) -> list[list[str]]:
        """Each prompt's n completions: generate_texts with key's settings.

        key: (settings as sorted (name, value) pairs, n, tag); a streamed prompt comes as
        (prompt, sink) alone in its batch, and sink gets the text as each token completes it.
        """
        from attnlab.tasks.lm import generate_texts

        pairs, n, _ = key  # type: ignore[misc]
        settings = dict(pairs)
        if prompts and isinstance(prompts[0], tuple):
            prompt, sink = prompts[0]
            done = generate_texts(self.model, self.tokenizer, [prompt], **settings, on_text=sink)
            return [[done[0][1]]]
        done = generate_texts(self.model, self.tokenizer, prompts, num_samples=n, **settings)
        texts = [completion for _, completion in done]
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]


ServedModel = EncoderModel | TaskModel | TranslationModel | LanguageModel


def load_served(model_dir: str | Path, pooling: str = "mean") -> ServedModel:
    """The served model of a folder, of the kind its config.json and weights say."""
    from attnlab.interop.gpt2 import is_gpt_folder
    from attnlab.interop.hf import checkpoint_task
    from attnlab.tasks.translate import MODEL_TYPE

    path = Path(model_dir)
    if not path.is_dir():
        raise AttnlabError(f"model directory {path} not found", options=("model",))
    config = path / "config.json"
    if not config.is_file():
        raise AttnlabError(f"no config.json in {path}: is this a model folder?", options=("model",))
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise AttnlabError(f"cannot read {config}: {err}") from None
    if is_gpt_folder(path):
        return LanguageModel(path)
    if isinstance(data, dict) and data.get("model_type") == MODEL_TYPE:
        return TranslationModel(path)
    if checkpoint_task(path) is not None:
        return TaskModel(path)
    return EncoderModel(path, pooling)
