"""`attnlab <command>`: parses options and calls the library; results to stdout, messages to stderr.

Every AttnlabError becomes one line on stderr and exit code 2, never a traceback; so do an
OSError (a path through a file, a full disk, no permission) and running out of memory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from attnlab.errors import AttnlabError, first_line
from attnlab.io import json_safe

if TYPE_CHECKING:
    from attnlab.models.bert import BertModel
    from attnlab.models.seq2seq import Transformer
    from attnlab.text.bpe import BpeTokenizer
    from attnlab.text.tokenizer import BertTokenizer

EXIT_USAGE = 2
MAX_THREADS = 1024  # OpenMP fails to start many more (and a million crashes the process)
T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (usage text stays available through --help)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # argparse reads only -5 and -.5 as negative numbers: --lr -1e-3 and --lr -inf were
        # taken for options ("expected one argument") instead of values its check refuses.
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE
        )

    defaults_from: str | None = None  # see _command

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("attnlab").strip()  # "attnlab: error:" comes first
        raise AttnlabError(f"{command}: {message}" if command else message)

    def format_help(self) -> str:
        """The help, each flag left to the library followed by the default it has there."""
        if self.defaults_from is not None:
            defaults = _defaults_of(self.defaults_from)
            for action in self._actions:
                if action.dest in defaults and "default" not in (action.help or ""):
                    shown = f"default {defaults[action.dest]}".replace("%", "%%")
                    action.help = f"{action.help} ({shown})" if action.help else shown
        return super().format_help()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _unencodable(err: UnicodeEncodeError) -> str:
    """The message for text an encoding cannot write (stdout's, most often: a C locale)."""
    message = f"cannot write {err.object[err.start : err.start + 1]!r} in {err.encoding}"
    stdout = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if stdout == err.encoding.lower().replace("-", "") and stdout != "utf8":
        message += ", standard output's encoding: set PYTHONIOENCODING=utf-8"
    return message


def _print_json(result: dict) -> None:
    """One line of strict JSON on stdout: NaN (a diverged loss, a constant correlation) as null."""
    print(json.dumps(json_safe(result), default=str, ensure_ascii=False, allow_nan=False))


def _main_process() -> bool:
    """False in torchrun's other processes: a training job's result is printed once."""
    import os

    return os.environ.get("RANK", "0") == "0"


def _given(args: argparse.Namespace, *names: str) -> dict[str, object]:
    """The named flags that were given: the library's defaults apply to the others."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _flag_spelling(args: argparse.Namespace | None) -> Callable[[str], str]:
    """How the CLI says a library option (AttnlabError.options): its command's flag for it.

    An option of another command is said as that command's flag (evaluate, loading a model
    whose head only finetune's --new-head can replace); one no command has stays as named.
    """
    parser = getattr(args, "command_parser", None)
    actions = parser._actions if parser is not None else []
    flags = {a.dest: max(a.option_strings, key=len) for a in actions if a.option_strings}
    return lambda name: flags.get(name) or _any_command_flag(name)


def _any_command_flag(name: str) -> str:
    """--name-with-dashes if some attnlab command has that flag, else name itself."""
    flag = "--" + name.replace("_", "-")
    parsers, seen = [build_parser()], set()
    while parsers:
        for action in parsers.pop()._actions:
            seen.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return flag if flag in seen else name


def _set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None) is not None:  # 0 is an error, not "unset"
        import torch

        if not 1 <= args.threads <= MAX_THREADS:
            raise AttnlabError(f"--threads must be from 1 to {MAX_THREADS}, got {args.threads}")
        torch.set_num_threads(args.threads)


def read_lines(path: str | None) -> list[str]:
    """All lines of a UTF-8 file (.gz too) or of stdin (path None or '-'), without line endings."""
    from attnlab.text.parallel import decode_lines, read_text_lines

    if path not in (None, "-"):
        return read_text_lines(Path(path))
    if sys.stdin is None:  # the shell closed it (<&-)
        raise AttnlabError("standard input is closed: give the text in a file (--input FILE)")
    return decode_lines(sys.stdin.buffer.read(), "stdin")


def _load(model_dir: str, mlm: bool = False) -> tuple[BertModel, BertTokenizer]:
    """A checkpoint's model (with its trained masked-LM head if mlm) and its tokenizer."""
    from attnlab.interop.hf import check_vocabulary, load_bert, read_config
    from attnlab.text.tokenizer import BertTokenizer

    config = read_config(Path(model_dir))  # config problems first: they explain most failures
    tokenizer = BertTokenizer.from_dir(model_dir)
    check_vocabulary(Path(model_dir), tokenizer.vocab_size, config)
    return load_bert(model_dir, heads=mlm, trained_heads=mlm), tokenizer


# ------------------------------------------------------------------------------- commands


def cmd_info(args: argparse.Namespace) -> None:
    """Print the model's config and parameter count as JSON, or the speed-ups and their route."""
    from attnlab.interop.hf import describe, load_bert

    if args.speedups:
        from attnlab import fast

        print(fast.report())
        return
    if args.model is None:
        raise AttnlabError("info: pass --model DIR, or --speedups")
    print(json.dumps(describe(load_bert(args.model)), indent=2))


def cmd_tokenize(args: argparse.Namespace) -> None:
    """stdin lines -> one JSON object per line with input_ids and token_type_ids."""
    from attnlab.interop.hf import read_config
    from attnlab.text.tokenizer import BertTokenizer

    config = read_config(Path(args.model))
    tokenizer = BertTokenizer.from_dir(args.model)
    lines = read_lines(args.input)
    max_length = _max_length(args.max_length, config.max_positions)
    texts, pairs = lines, None
    if args.pair:
        split = [line.split("\t", 1) for line in lines]
        bad = next((i for i, parts in enumerate(split) if len(parts) != 2), None)
        if bad is not None:
            raise AttnlabError(f"--pair: line {bad + 1} has no TAB between sentence A and B")
        texts, pairs = [a for a, _ in split], [b for _, b in split]
    encodings = tokenizer.encode_batch(texts, pairs, max_length=max_length)
    _check_truncation(encodings, max_length, args.no_truncate)
    out = sys.stdout
    for enc in encodings:
        out.write(json.dumps({"input_ids": enc.ids, "token_type_ids": enc.type_ids}) + "\n")


def _max_length(requested: int | None, limit: int) -> int:
    if requested is None:
        return limit
    if requested < 2:
        raise AttnlabError("--max-length must be at least 2 ([CLS] and [SEP])")
    if requested > limit:
        raise AttnlabError(f"--max-length {requested} is above the model's maximum ({limit})")
    return requested


def _check_truncation(encodings: Sequence, max_length: int, no_truncate: bool) -> None:
    truncated = [i for i, e in enumerate(encodings) if e.truncated]
    if not truncated:
        return
    if no_truncate:
        raise AttnlabError(
            f"input line {truncated[0] + 1} is longer than {max_length} tokens "
            "(drop --no-truncate to truncate it)"
        )
    _say(f"warning: {len(truncated)} input line(s) longer than {max_length} tokens were truncated")


def cmd_embed(args: argparse.Namespace) -> None:
    """Input lines -> one JSON array (vector, or per-token vectors) per line, in input order."""
    import torch

    from attnlab.interop.hf import sentence_max_length
    from attnlab.io import check_output_file
    from attnlab.progress import progress_bar
    from attnlab.tasks.embed import check_output_suffix, embed, json_line, write_embeddings

    output = None
    if args.output is not None:  # before the model and the input: a bad --output fails fast
        check_output_suffix(args.output, args.pooling or "mean")
        output = check_output_file(args.output, args.overwrite, [args.model, args.input or "-"])
    model, tokenizer = _load(args.model)  # before stdin: a bad --model must not wait for input
    limit = model.config.max_positions
    if args.max_length is None:  # a sentence-transformers folder's own length, as its encode()
        max_length = min(sentence_max_length(Path(args.model)) or limit, limit)
    else:
        max_length = _max_length(args.max_length, limit)
    lines = read_lines(args.input)
    dtype = {None: None, "fp32": None, "bf16": torch.bfloat16}[args.dtype]
    with progress_bar(len(lines), "line", args.progress) as progress:
        vectors = embed(
            model,
            tokenizer,
            lines,
            **_given(args, "pooling", "max_tokens", "max_batch"),
            normalize=args.normalize,
            max_length=max_length,
            truncate=not args.no_truncate,
            dtype=dtype,
            on_truncate=lambda n: _say(
                f"warning: {n} input line(s) longer than {max_length} tokens were truncated"
            ),
            progress=progress,
        )
    if output is not None:
        write_embeddings(vectors, output, model.config.d_model)
        return
    sys.stdout.writelines(json_line(vector) for vector in vectors)  # strict JSON: NaN is null


def cmd_export(args: argparse.Namespace) -> None:
    """Write the model in HF transformers' layout to --out."""
    from attnlab.interop.gpt2 import is_gpt_folder
    from attnlab.interop.hf import (
        checkpoint_task,
        load_bert,
        read_config,
        save_bert,
        task_hf_incompatible,
    )
    from attnlab.io import check_out_dir
    from attnlab.text.tokenizer import BertTokenizer

    check_out_dir(Path(args.out), args.overwrite, inputs=[args.model])
    if is_gpt_folder(args.model):  # a decoder-only LM: HF GPT-2's layout
        _export_gpt(args)
        return
    read_config(Path(args.model))  # config problems first, as in _load
    task = checkpoint_task(args.model)
    if task is not None and (reason := task_hf_incompatible(args.model)):
        raise AttnlabError(
            f"cannot export to HF format: {args.model} is a fine-tuned {task} model with "
            f"{reason}; it loads in attnlab only"
        )
    if task is not None:  # export writes encoders and pretraining heads; it would drop this head
        raise AttnlabError(
            f"{args.model} is a fine-tuned {task} model, already in HF transformers' layout "
            "(load it with from_pretrained): export writes BERT encoders and pretraining heads"
        )
    model = load_bert(args.model, heads=_has_heads(args.model))
    tokenizer = BertTokenizer.from_dir(args.model)
    save_bert(model, args.out, tokenizer, overwrite=args.overwrite, require_hf=True)
    _say(f"exported {args.model} -> {args.out} (HF BERT layout)")


def _export_gpt(args: argparse.Namespace) -> None:
    """cmd_export for a GPT folder: GPT2LMHeadModel's layout, with the tokenizer if it has one."""
    from attnlab.interop.gpt2 import load_gpt, save_gpt
    from attnlab.text.lm_tokenizer import LMTokenizer

    model_dir = Path(args.model)
    has_tokenizer = (model_dir / "tokenizer.json").is_file() or (
        (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file()
    )
    tokenizer = LMTokenizer.from_dir(model_dir) if has_tokenizer else None
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    save_gpt(
        load_gpt(model_dir), args.out, tokenizer, args.overwrite, require_hf=True, eos_id=eos_id
    )
    _say(f"exported {args.model} -> {args.out} (HF GPT-2 layout)")


def _has_heads(model_dir: str) -> bool:
    from attnlab.interop.hf import read_weights

    return any(k.startswith("cls.predictions") for k in read_weights(Path(model_dir)))


def cmd_tokenizer_train(args: argparse.Namespace) -> None:
    """Train a WordPiece (BERT) or joint BPE (translation) vocabulary and save it to --out."""
    from attnlab.io import check_out_dir, staged_dir
    from attnlab.text.bpe import train_bpe
    from attnlab.text.tokenizer import train_wordpiece

    files = [*(args.corpus or []), *args.files]
    check_out_dir(Path(args.out), args.overwrite, inputs=files)
    if not files:
        raise AttnlabError("tokenizer train needs text files (FILES... or --corpus)")
    if args.type in ("byte-bpe", "char"):  # a language model's (text/lm_tokenizer.py)
        _train_lm_tokenizer(args, files)
        return
    vocab_size = args.vocab_size
    if vocab_size is None:
        vocab_size = 8000 if args.type == "bpe" else 30522
    if vocab_size < 10:
        raise AttnlabError("--vocab-size must be at least 10")
    if args.type == "bpe" and args.cased:
        raise AttnlabError("--cased is a WordPiece option: a BPE vocabulary always keeps case")
    if args.type == "bpe":
        tokenizer = train_bpe(files, vocab_size)
    else:
        tokenizer = train_wordpiece(files, vocab_size, lowercase=not args.cased)
    with staged_dir(Path(args.out), args.overwrite) as stage:
        tokenizer.save(stage)
    kind = "BPE" if args.type == "bpe" else "WordPiece"
    _say(f"trained a {kind} vocabulary of {tokenizer.vocab_size} tokens -> {args.out}")
    if tokenizer.vocab_size > vocab_size:
        _say(
            f"note: more than --vocab-size {vocab_size}: the corpus's characters and the "
            "special tokens alone take that many"
        )


def _train_lm_tokenizer(args: argparse.Namespace, files: list[str]) -> None:
    """`tokenizer train --type byte-bpe|char`: a language model's vocabulary in --out."""
    from attnlab.io import staged_dir
    from attnlab.text.lm_tokenizer import train_byte_bpe, train_char

    if args.cased:
        raise AttnlabError(f"--cased is a WordPiece option: {args.type} always keeps case")
    if args.type == "char" and args.vocab_size is not None:
        raise AttnlabError("--vocab-size does not apply to char: the corpus's characters are it")
    if args.type == "char":
        tokenizer = train_char(files)
    else:
        tokenizer = train_byte_bpe(files, 8000 if args.vocab_size is None else args.vocab_size)
    with staged_dir(Path(args.out), args.overwrite) as stage:
        tokenizer.save(stage)
    _say(f"trained a {args.type} vocabulary of {tokenizer.vocab_size} tokens -> {args.out}")


def _yaml_load(text: str) -> object:
    """YAML's safe load, where 1e-4 is a number as in YAML 1.2 (PyYAML's 1.1 reads a string)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            # A repeated key kept the last value in silence (TOML refuses it).
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for i, key in enumerate(keys):
                if key in keys[:i]:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", node.start_mark
                    )
            return super().construct_mapping(node, deep)

    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789"))
    return yaml.load(text, Loader=Loader)  # a SafeLoader: no Python objects


def read_config_file(path: str) -> dict[str, object]:
    """Options from a TOML or YAML file (keys as the long flags, '-' or '_' alike)."""
    from attnlab.io import check_input_file, check_no_lone_surrogates

    file = check_input_file(Path(path), "--config file")
    text = file.read_bytes()
    try:
        if file.suffix.lower() in (".yaml", ".yml", ".json"):  # JSON is YAML too
            data = _yaml_load(text.decode("utf-8-sig"))
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            data = tomllib.loads(text.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise AttnlabError(f"{file} is not valid UTF-8") from None
    except Exception as err:  # the TOML and YAML parsers raise their own error types
        raise AttnlabError(f"{file}: cannot parse ({first_line(err)})") from None
    if not isinstance(data, dict):
        raise AttnlabError(f"{file}: expected a table of options")
    check_no_lone_surrogates(data, str(file))  # YAML's "\ud800", as JSON's: no character
    options: dict[str, object] = {}
    spelled: dict[str, object] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in options:  # batch-size and batch_size: one would win in silence
            raise AttnlabError(f"{file}: {spelled[name]!r} and {key!r} are the same option")
        options[name], spelled[name] = value, key
    return options


def options_from(
    cls: type[T], args: argparse.Namespace, required: tuple[str, ...], paths: tuple[str, ...]
) -> T:
    """A job's options dataclass from --config (TOML/YAML) overridden by the given flags."""
    import dataclasses
    import typing

    from attnlab.config import check_types

    fields = {f.name for f in dataclasses.fields(cls)}
    lists = [k for k, hint in typing.get_type_hints(cls).items() if typing.get_origin(hint) is list]
    values: dict[str, object] = {}
    if args.config:
        # null in the file means "not given", as an absent flag does: the default applies
        from_file = {k: v for k, v in read_config_file(args.config).items() if v is not None}
        threads = from_file.pop("threads", None)  # the one option that is not the job's
        if threads is not None and getattr(args, "threads", None) is None:
            if not isinstance(threads, int) or isinstance(threads, bool):
                raise AttnlabError(f"--config {args.config}: threads must be an integer")
            args.threads = threads
            _set_threads(args)
        for key in lists:  # one file needs no list
            if isinstance(from_file.get(key), str):
                from_file[key] = [from_file[key]]
            if from_file.get(key) == []:  # not the same as leaving it out (a default applies)
                raise AttnlabError(
                    f"--config {args.config}: {key} is an empty list: name a file, or leave "
                    f"{key} out"
                )
        check_types(cls, from_file, f"--config {args.config}")  # flags are typed by argparse
        values.update(from_file)
    values.update({k: v for k, v in vars(args).items() if k in fields and v is not None})
    unknown = sorted(set(values) - fields)
    if unknown:
        raise AttnlabError(f"--config: unknown option(s) {', '.join(unknown)}")
    for key in required:
        if key not in values:
            raise AttnlabError(f"{args.command} needs --{key} (or '{key}' in --config)")
    for key in paths:
        if values.get(key) is not None:
            values[key] = Path(str(values[key]))
    if args.config and values.get("overwrite") and values.get("out") is not None:
        from attnlab.io import check_out_location  # --overwrite replaces --out as a whole

        check_out_location(Path(str(values["out"])), [args.config])
    for key in lists:  # corpus (pretrain, distill), train and valid (translate): file lists
        if values.get(key) is not None:
            values[key] = [Path(str(item)) for item in values[key]]
    try:
        return cls(**values)
    except TypeError as err:
        raise AttnlabError(f"{args.command}: bad option ({err})") from None


def cmd_pretrain(args: argparse.Namespace) -> None:
    """Pretrain a BERT (MLM + NSP / MLM / MLM + SOP) on text files; resumable."""
    from attnlab.tasks.pretrain import PretrainOptions, pretrain

    options = options_from(
        PretrainOptions, args, ("out",), ("out", "tokenizer", "init", "cache_dir")
    )
    summary = pretrain(options)
    if _main_process():
        _print_json({k: v for k, v in summary.items() if k != "checkpoint"})
        _say(f"pretrained model written to {options.out}")


def cmd_fill_mask(args: argparse.Namespace) -> None:
    """Print the top-k fillers of each [MASK] with their probabilities."""
    from attnlab.tasks.pretrain import fill_mask

    for number, text in enumerate(args.text, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # bytes Python kept as lone surrogates
            raise AttnlabError(
                f"text {number} is not valid UTF-8 (byte {ord(text[err.start]) - 0xDC00:#04x} "
                f"at character {err.start + 1})"
            ) from None
    model, tokenizer = _load(args.model, mlm=True)
    for text in args.text:
        predictions = fill_mask(
            model, tokenizer, text, **_given(args, "top_k"),
            on_truncate=lambda n: _say(
                f"warning: a text of {n} tokens was cut to the model's {model.config.max_positions}"
            ),
        )  # fmt: skip
        if args.json:
            _print_json({"text": text, "masks": predictions})
            continue
        print(text)
        for i, options in enumerate(predictions, 1):
            shown = "  ".join(f"{token} {prob:.3f}" for token, prob in options)
            print(f"  [MASK] {i}: {shown}")


def cmd_distill(args: argparse.Namespace) -> None:
    """Distil a smaller BERT from a teacher checkpoint (DistilBERT); resumable."""
    from attnlab.tasks.distill import DistillOptions, distill

    options = options_from(
        DistillOptions, args, ("teacher", "out"), ("teacher", "out", "cache_dir")
    )
    summary = distill(options)
    if _main_process():
        _print_json({k: v for k, v in summary.items() if k != "checkpoint"})
        _say(f"distilled student written to {options.out}")


def cmd_finetune(args: argparse.Namespace) -> None:
    """Fine-tune a BERT checkpoint on a task file; keeps the best dev model in --out."""
    from attnlab.tasks.finetune import FinetuneOptions, finetune

    options = options_from(
        FinetuneOptions, args, ("task", "model", "train", "out"), ("model", "train", "dev", "out")
    )
    summary = finetune(options)
    if _main_process():  # the other ranks' summaries have no results
        results = summary["results"]
        _print_json(results)
        kept = results["best"] or results["final"]
        _say(f"fine-tuned model ({results['kept']}, step {kept['step']}) written to {options.out}")


def _data_overrides(args: argparse.Namespace) -> dict[str, object]:
    keys = ("columns", "text_column", "text_pair_column", "label_column", "tag_column")
    keys += ("max_length", "doc_stride")
    return {key: getattr(args, key) for key in keys}


def cmd_evaluate(args: argparse.Namespace) -> None:
    """Score a fine-tuned model on a labelled file: one JSON line of metrics."""
    from attnlab.tasks.finetune import evaluate_file

    metrics = evaluate_file(
        args.model, args.data, args.task, _data_overrides(args), **_given(args, "batch_size"),
        progress=args.progress,
    )  # fmt: skip
    _print_json(metrics)


def cmd_predict(args: argparse.Namespace) -> None:
    """Write a fine-tuned model's predictions for an input file to --output."""
    from attnlab.tasks.finetune import predict_file

    n = predict_file(
        args.model,
        args.input,
        args.output,
        args.task,
        _data_overrides(args),
        overwrite=args.overwrite,
        **_given(args, "batch_size"),
        progress=args.progress,
    )
    _say(f"wrote predictions for {n} example(s) to {args.output}")


class _TranslateOption(argparse.Action):
    """An option of `translate` itself, noted when given: argparse gives `train` and `score`
    their own defaults over the options before them, so there it is refused, not dropped."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.translate_options = [*getattr(namespace, "translate_options", []), option_string]


def _check_no_translate_options(args: argparse.Namespace) -> None:
    """Refuse `translate --beam 1 score ...`: the 1 would be replaced by score's default 4."""
    given = getattr(args, "translate_options", [])
    if given:
        command = args.translate_command
        raise AttnlabError(
            f"translate {command}: {', '.join(given)} before '{command}' would be ignored (an "
            f"option there is plain `translate`'s): give `translate {command}` options after "
            f"'{command}'"
        )


def _search(args: argparse.Namespace) -> dict[str, object]:
    """translate_lines' search settings from the decoding flags given (its defaults: the rest)."""
    search = _given(args, "beam", "length_penalty", "batch_size", "max_len_a", "max_len_b")
    search |= _given(args, "workers")
    if args.greedy:
        search["beam"] = 1
    return search


# SearchOptions' fields and the flags that set them: its errors are worded in the fields' names.
_SEARCH_FLAGS = {
    "beam_size": "--beam",
    "length_penalty": "--length-penalty",
    "max_len_a": "--max-len-a",
    "max_len_b": "--max-len-b",
}


def _check_search(search: dict[str, object]) -> None:
    """Refuse search settings as SearchOptions does, naming the flags."""
    from attnlab.decode import SearchOptions

    fields = {"beam_size" if k == "beam" else k: v for k, v in search.items()}
    try:
        SearchOptions(**{k: v for k, v in fields.items() if k in _SEARCH_FLAGS})
    except AttnlabError as err:
        message = str(err)
        for field, flag in _SEARCH_FLAGS.items():
            message = message.replace(field, flag)
        raise AttnlabError(message) from None


def _translate(
    args: argparse.Namespace, model: Transformer, tokenizer: BpeTokenizer, lines: list[str]
) -> list[str]:
    """Translate lines with the decoding flags of translate / translate score."""
    from attnlab.progress import progress_bar
    from attnlab.tasks.translate import translate_lines

    search = _search(args)
    _check_search(search)
    with progress_bar(len(lines), "line", args.progress) as progress:
        return translate_lines(
            model,
            tokenizer,
            lines,
            **search,
            on_truncate=lambda n: _say(f"warning: {n} source line(s) too long were truncated"),
            progress=progress,
        )


def cmd_translate(args: argparse.Namespace) -> None:
    """Translate stdin (or --input) lines with a trained model: one line out per line in."""
    from attnlab.tasks.translate import load_translation_model

    if not args.model:
        raise AttnlabError("translate needs --model DIR (or a subcommand: translate train|score)")
    model, tokenizer = load_translation_model(args.model)  # before stdin: fail fast
    lines = read_lines(args.input)
    hyps = _translate(args, model, tokenizer, lines)
    sys.stdout.write("".join(hyp + "\n" for hyp in hyps))


def cmd_translate_train(args: argparse.Namespace) -> None:
    """Train (or resume) a Transformer translation model on parallel text."""
    from attnlab.tasks.translate import TranslateOptions, train_translation

    _check_no_translate_options(args)
    options = options_from(TranslateOptions, args, ("out",), ("out", "tokenizer"))
    summary = train_translation(options, say=_say)
    if not _main_process():
        return
    _print_json({k: v for k, v in summary.items() if k != "checkpoint"})
    if summary.get("averaged_steps"):
        _say(f"final model = average of the checkpoints of steps {summary['averaged_steps']}")
    _say(f"translation model written to {options.out}")


def cmd_translate_score(args: argparse.Namespace) -> None:
    """Translate --src and print sacreBLEU against --ref as one JSON line."""
    from attnlab.metrics import bleu_metric, corpus_bleu
    from attnlab.tasks.translate import load_translation_model

    _check_no_translate_options(args)
    if args.tokenize is not None:  # a tokenizer that cannot run is said before the translating
        bleu_metric(args.tokenize)
    model, tokenizer = load_translation_model(args.model)
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise AttnlabError(
            f"--src has {len(sources)} lines but --ref has {len(references)}: they must align"
        )
    hyps = _translate(args, model, tokenizer, sources)
    result = corpus_bleu(hyps, references, tokenize=args.tokenize)
    beam = _search(args).get("beam", _defaults_of(_TRANSLATE_LINES)["beam"])
    _print_json({**result, "beam": beam})


# ------------------------------------------------------------------------------- parser

_Commands = argparse._SubParsersAction  # what add_subparsers returns
COMMAND_FAMILIES = ("ablate", "attention", "serve", "lm")  # modules of attnlab/commands/
_TASKS = ("classify", "regress", "ner", "qa")
_PRETRAIN = "attnlab.tasks.pretrain.PretrainOptions"
_DISTILL = "attnlab.tasks.distill.DistillOptions"
_FINETUNE = "attnlab.tasks.finetune.FinetuneOptions"
_TRANSLATE = "attnlab.tasks.translate.TranslateOptions"
_TRANSLATE_LINES = "attnlab.tasks.translate.translate_lines"


def _defaults_of(source: str) -> dict[str, object]:
    """The plain defaults (numbers, strings) of a dataclass's fields or a function's parameters."""
    import dataclasses
    import importlib
    import inspect

    module, _, name = source.rpartition(".")
    target = getattr(importlib.import_module(module), name)
    if dataclasses.is_dataclass(target):
        pairs = [(f.name, f.default) for f in dataclasses.fields(target)]
    else:
        pairs = [(p.name, p.default) for p in inspect.signature(target).parameters.values()]
    return {
        name: value
        for name, value in pairs
        if isinstance(value, (int, float, str)) and not isinstance(value, bool)
    }


def _command(
    commands: _Commands,
    name: str,
    func: Callable[[argparse.Namespace], None],
    text: str,
    defaults_from: str | None = None,
) -> _Parser:
    """A command's parser with the flag every command takes (--threads).

    defaults_from ("module.name"): the options dataclass or function whose defaults the flags
    left out take; such flags default to None, and --help shows the defaults read from there.
    """
    sub = commands.add_parser(name, help=text, description=text)
    sub.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    sub.set_defaults(func=func, command_parser=sub)
    sub.defaults_from = defaults_from
    return sub


def _add_run_flags(sub: argparse.ArgumentParser, out_help: str) -> None:
    """The options of every training job: --config, --out and the shared RunOptions."""
    sub.add_argument("--config", help="TOML or YAML file with any of these options")
    sub.add_argument("--out", help=out_help)
    sub.add_argument("--lr", type=float, help="peak learning rate")
    sub.add_argument("--save-every", type=int, help="steps between checkpoints")
    sub.add_argument("--keep-last", type=int, help="checkpoints kept (0: all)")
    sub.add_argument("--log-every", type=int, help="steps between log rows")
    sub.add_argument("--resume", action="store_true", default=None, help="continue --out's run")
    sub.add_argument("--overwrite", action="store_true", default=None, help="replace --out")
    sub.add_argument("--seed", type=int, help="seed of every random draw")
    sub.add_argument("--precision", choices=("fp32", "bf16"), help="training arithmetic")
    sub.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                     help="no progress bar on stderr")  # fmt: skip


def _add_corpus_flags(sub: argparse.ArgumentParser, warmup_share: str) -> None:
    """The options pretrain and distill share: corpus, batches, masking, schedule."""
    sub.add_argument("--corpus", nargs="+", help="UTF-8 text files (default: bundled sample)")
    sub.add_argument("--cache-dir", help="where tokenized corpora are cached")
    sub.add_argument("--steps", type=int, help="optimiser steps")
    sub.add_argument("--batch-size", type=int, help="examples per optimiser step")
    sub.add_argument("--grad-accum", type=int, help="micro-batches per step")
    sub.add_argument("--seq-len", type=int, help="tokens per example")
    sub.add_argument(
        "--warmup", type=int, help=f"warm-up steps (default {warmup_share} of --steps)"
    )
    sub.add_argument("--eval-every", type=int, help="steps between held-out evaluations")
    sub.add_argument("--whole-word-masking", action="store_true", default=None)
    sub.add_argument("--static-masking", action="store_true", default=None)
    sub.add_argument(
        "--max-predictions", type=int, help="masked tokens per sequence at most (default: no cap)"
    )
    sub.add_argument(
        "--compile", action="store_true", default=None, help="torch.compile the forward pass"
    )


def _corpus_job_command(
    commands: _Commands,
    name: str,
    func: Callable[[argparse.Namespace], None],
    text: str,
    defaults_from: str,
    warmup_share: str,
) -> _Parser:
    """pretrain or distill: a training job's flags and the corpus flags both share."""
    sub = _command(commands, name, func, text, defaults_from)
    _add_run_flags(sub, "output directory (an HF-compatible checkpoint)")
    _add_corpus_flags(sub, warmup_share)
    return sub


def _add_numbers(sub: argparse.ArgumentParser, *flags: tuple[str, type, str]) -> None:
    """Flags that take one number each: (flag, int or float, help), in --help's order."""
    for flag, kind, text in flags:
        sub.add_argument(flag, type=kind, help=text)


def _add_data_flags(sub: argparse.ArgumentParser, trained: bool = False) -> None:
    """How a task file is read; trained: evaluate/predict, whose defaults are training's."""
    saved = " (default: as in training)" if trained else ""
    sub.add_argument(
        "--columns",
        help="names of a headerless table's columns, comma-separated (a,b,label); a first "
        "row that repeats them is skipped as a header",
    )
    sub.add_argument("--text-column", help="table column of the text" + saved)
    sub.add_argument("--text-pair-column", help="table column of the second text of a pair")
    sub.add_argument("--label-column", help="table column of the label" + saved)
    sub.add_argument("--tag-column", type=int, help="ner: CoNLL column of the tag" + saved)
    sub.add_argument(
        "--max-length",
        type=int,
        help="tokens per input" + (saved or " (default 128, qa 384)"),
    )
    sub.add_argument("--doc-stride", type=int, help="qa: overlap of passage windows" + saved)


def _add_decoding_flags(sub: argparse.ArgumentParser, noted: bool = False) -> None:
    """How translations are searched (translate, translate score); noted: _TranslateOption."""
    store = _TranslateOption if noted else "store"
    sub.add_argument("--beam", type=int, action=store, help="beam size (the paper's)")
    flag = {"action": _TranslateOption, "nargs": 0, "const": True, "default": False}
    sub.add_argument("--greedy", **(flag if noted else {"action": "store_true"}),
                     help="greedy search (same as --beam 1)")  # fmt: skip
    sub.add_argument("--length-penalty", type=float, action=store, help="GNMT alpha")
    sub.add_argument("--batch-size", type=int, action=store, help="sentences per batch")
    sub.add_argument("--max-len-a", type=float, action=store, help="max output = a * src_len + b")
    sub.add_argument("--max-len-b", type=float, action=store)
    sub.add_argument(
        "--workers",
        action=store,
        type=int,
        help="batches decoded at once, sharing the threads, at most one per thread "
        "(default: one per thread on CPU)",
    )


def _add_progress_flag(sub: argparse.ArgumentParser, noted: bool = False) -> None:
    """--no-progress (attnlab/progress.py: by default a bar on a terminal or a long input)."""
    noted_flag = {"action": _TranslateOption, "nargs": 0}  # translate's own (_TranslateOption)
    sub.add_argument("--no-progress", dest="progress", const=False, default=None,
                     **(noted_flag if noted else {"action": "store_const"}),
                     help="no progress bar on stderr")  # fmt: skip


def _add_info_and_tokenize(commands: _Commands) -> None:
    """`attnlab info` and `attnlab tokenize`."""
    sub = _command(commands, "info", cmd_info,
                   "print a BERT model's config and parameter count as JSON")  # fmt: skip
    sub.add_argument("--model", help="BERT checkpoint directory (HF or attnlab)")
    sub.add_argument("--speedups", action="store_true", help="list the speed-ups and the route")

    sub = _command(commands, "tokenize", cmd_tokenize,
                   "tokenize lines to JSON input_ids/token_type_ids")  # fmt: skip
    sub.add_argument("--model", required=True)
    sub.add_argument("--input", help="UTF-8 text file (default: stdin)")
    sub.add_argument("--pair", action="store_true", help="lines are 'A<TAB>B' sentence pairs")
    sub.add_argument("--max-length", type=int)
    sub.add_argument("--no-truncate", action="store_true", help="over-long input is an error")


def _add_embed_and_export(commands: _Commands) -> None:
    """`attnlab embed` (its defaults: tasks/embed.py's embed) and `attnlab export`."""
    sub = _command(commands, "embed", cmd_embed,
                   "sentence embeddings, one JSON array per input line",
                   "attnlab.tasks.embed.embed")  # fmt: skip
    sub.add_argument("--model", required=True)
    sub.add_argument("--input", help="UTF-8 text file (default: stdin)")
    sub.add_argument("--pooling", choices=("mean", "cls", "none"))
    sub.add_argument("--normalize", action="store_true", help="L2-normalise each vector")
    # dest: embed's own names, so that its messages name these flags (_flag_spelling)
    sub.add_argument(
        "--batch-size", dest="max_batch", type=int, metavar="N", help="most sentences per batch"
    )
    sub.add_argument("--batch-tokens", dest="max_tokens", type=int, metavar="N",
                     help="most padded tokens per batch")  # fmt: skip
    sub.add_argument(
        "--max-length",
        type=int,
        help="(default: a sentence-transformers folder's max_seq_length, else the model's maximum)",
    )
    sub.add_argument("--no-truncate", action="store_true", help="over-long input is an error")
    sub.add_argument("--dtype", choices=("fp32", "bf16"), help="(default fp32)")
    sub.add_argument("--output", help=".npy, .jsonl or .safetensors file (default: stdout)")
    sub.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    _add_progress_flag(sub)

    sub = _command(
        commands, "export", cmd_export, "write a model in HF transformers' BERT or GPT-2 layout"
    )
    sub.add_argument("--model", required=True)
    sub.add_argument("--format", choices=("hf",), default="hf")
    sub.add_argument("--out", required=True)
    sub.add_argument("--overwrite", action="store_true")


def _add_pretrain(commands: _Commands) -> None:
    """`attnlab pretrain` (PretrainOptions) and `attnlab fill-mask`."""
    sub = _corpus_job_command(commands, "pretrain", cmd_pretrain,
                              "pretrain a BERT on text files (resumable)", _PRETRAIN, "10%%")  # fmt: skip
    sub.add_argument("--preset", help="model size (default bert-mini, or --init's)")
    sub.add_argument("--objective", choices=("mlm+nsp", "mlm", "mlm+sop"))
    sub.add_argument("--tokenizer", help="use this vocabulary instead of training one")
    sub.add_argument(
        "--vocab-size", type=int, help="size of the vocabulary trained on --corpus (default 8000)"
    )
    sub.add_argument("--init", help="start from this checkpoint instead of random weights")
    sub.add_argument("--position-encoding", help="(default: learned, BERT's)")
    sub.add_argument("--embedding-size", type=int, help="ALBERT factorised embedding size")
    sub.add_argument("--share-layers", action="store_true", default=None, help="ALBERT sharing")
    sub.add_argument("--dropout", type=float, help="hidden and attention dropout (the preset's)")

    sub = _command(commands, "fill-mask", cmd_fill_mask, "predict the tokens hidden by [MASK]",
                   "attnlab.tasks.pretrain.fill_mask")  # fmt: skip
    sub.add_argument("--model", required=True)
    sub.add_argument("--top-k", type=int, help="predictions shown per [MASK]")
    sub.add_argument("--json", action="store_true", help="one JSON object per text")
    sub.add_argument("text", nargs="+", help="text with one or more [MASK]")


def _add_distill(commands: _Commands) -> None:
    """`attnlab distill` (DistillOptions)."""
    sub = _corpus_job_command(commands, "distill", cmd_distill,
                              "distil a smaller BERT from a teacher (DistilBERT)", _DISTILL, "5%%")  # fmt: skip
    sub.add_argument("--teacher", help="teacher checkpoint directory (HF or attnlab BERT)")
    sub.add_argument("--student-layers", type=int, help="student = teacher with N layers")
    sub.add_argument("--student-preset", help="student = a fresh model of this size")
    _add_numbers(
        sub,
        ("--temperature", float, "softmax temperature T"),
        ("--alpha-ce", float, "weight of the KL term"),
        ("--alpha-mlm", float, "weight of the student's MLM loss"),
        ("--alpha-cos", float, "weight of the cosine term (default 1; 0 if widths differ)"),
    )


# finetune's settings left to tasks/finetune/defaults.py
_CHOSEN = " (default: for the model and data, printed at the start; docs/finetuning.md)"


def _add_finetune(commands: _Commands) -> None:
    """`attnlab finetune` (FinetuneOptions)."""
    sub = _command(commands, "finetune", cmd_finetune,
                   "fine-tune BERT on classify/regress/ner/qa data", _FINETUNE)  # fmt: skip
    _add_run_flags(sub, "output directory (an HF-loadable fine-tuned checkpoint)")
    lr = next(action for action in sub._actions if action.dest == "lr")
    lr.help += " (default: by the model's hidden size, printed at the start)"
    sub.add_argument("--task", choices=_TASKS, help="classify, regress, ner or qa")
    sub.add_argument("--model", help="checkpoint to start from (attnlab or HF BERT)")
    sub.add_argument("--train", help="training file: .tsv/.csv/.jsonl, CoNLL, SQuAD .json")
    sub.add_argument("--dev", help="dev file: scored each epoch, the best model is kept")
    _add_numbers(
        sub,
        ("--epochs", int, "passes over --train" + _CHOSEN),
        ("--steps", int, "optimiser steps (overrides --epochs)"),
        ("--batch-size", int, "examples per step" + _CHOSEN),
        ("--warmup-ratio", float, "warm-up share of steps" + _CHOSEN),
        ("--weight-decay", float, "AdamW weight decay"),
        ("--eval-every", int, "steps between dev scores (default: epoch)"),
        ("--max-seconds", float, "stop training after this long"),
    )
    sub.add_argument("--best-metric", help="dev metric that picks the kept model")
    sub.add_argument("--pooling", choices=("cls", "mean"),
                     help="classify/regress: what the head reads, the [CLS] pooler or the mean "
                     "of the token states (default: mean for a sentence-transformers "
                     "checkpoint pooled so, else cls; printed at the start)")  # fmt: skip
    sub.add_argument("--new-head", action="store_true", default=None,
                     help="replace a fine-tuned --model's head (other task or labels)")  # fmt: skip
    sub.add_argument("--max-answer-length", type=int, help="qa: longest answer in tokens")
    sub.add_argument("--language", choices=("auto", "en", "zh"), help="qa: scoring rule")
    sub.add_argument("--fix-answer-offsets", action="store_true", default=None,
                     help="qa: move a training answer whose offset is wrong to where its "
                     "text occurs (default: error)")  # fmt: skip
    sub.add_argument("--train-answers", choices=("all", "first"),
                     help="qa: train on every gold answer of a question (all) or on its "
                     "first only, as HF run_qa does")  # fmt: skip
    _add_data_flags(sub)


def _add_evaluate_and_predict(commands: _Commands) -> None:
    """`attnlab evaluate` and `attnlab predict` (a fine-tuned model's data settings apply)."""
    sub = _finetuned_model_command(commands, "evaluate", cmd_evaluate,
                                   "score a fine-tuned model on a labelled file",
                                   {"--data": "labelled file in the task's format"})  # fmt: skip
    _add_progress_flag(sub)
    _add_data_flags(sub, trained=True)

    files = {"--input": "file in the task's format (labels unused)",
             "--output": "JSONL, CoNLL (ner) or SQuAD JSON (qa)"}  # fmt: skip
    sub = _finetuned_model_command(commands, "predict", cmd_predict,
                                   "write a fine-tuned model's predictions for a file", files)  # fmt: skip
    sub.add_argument("--overwrite", action="store_true")
    _add_progress_flag(sub)
    _add_data_flags(sub, trained=True)


def _finetuned_model_command(
    commands: _Commands,
    name: str,
    func: Callable[[argparse.Namespace], None],
    text: str,
    files: dict[str, str],
) -> _Parser:
    """evaluate or predict (defaults: finetune's NAME_file): --model, the files, --task, batch."""
    sub = _command(commands, name, func, text, f"attnlab.tasks.finetune.{name}_file")
    sub.add_argument("--model", required=True, help="fine-tuned checkpoint directory")
    for flag, help_text in files.items():
        sub.add_argument(flag, required=True, help=help_text)
    sub.add_argument("--task", choices=_TASKS, help="must match the model's (default: its own)")
    sub.add_argument("--batch-size", type=int, help="examples per batch")
    return sub


def _add_translate_commands(commands: _Commands) -> None:
    """`attnlab translate [--model DIR ...]`, `translate train ...` and `translate score ...`."""
    text = "translate stdin lines with a trained model; or `translate train|score ...`"
    sub = commands.add_parser("translate", help=text, description=text)
    sub.set_defaults(func=cmd_translate, command_parser=sub)
    sub.defaults_from = _TRANSLATE_LINES
    sub.add_argument("--threads", type=int, action=_TranslateOption,
                     help="torch threads (default: torch's choice)")  # fmt: skip
    sub.add_argument("--model", action=_TranslateOption,
                     help="translation model directory (from `translate train`)")  # fmt: skip
    sub.add_argument("--input", action=_TranslateOption,
                     help="UTF-8 source file (default: stdin)")  # fmt: skip
    _add_decoding_flags(sub, noted=True)
    _add_progress_flag(sub, noted=True)
    # An optional subcommand: without one, `translate` itself translates (the common case).
    actions = sub.add_subparsers(
        dest="translate_command", metavar="{train,score}", parser_class=_Parser
    )
    _add_translate_train(actions)
    text = "translate --src and print sacreBLEU against --ref as JSON"
    score = _command(actions, "score", cmd_translate_score, text, _TRANSLATE_LINES)
    score.add_argument("--model", required=True, help="translation model directory")
    score.add_argument("--src", required=True, help="source sentences, one a line")
    score.add_argument("--ref", required=True, help="reference translations, one a line")
    score.add_argument(
        "--tokenize",
        help="sacreBLEU tokenizer (default: zh when the references are mostly Chinese, else 13a)",
    )
    _add_decoding_flags(score)
    _add_progress_flag(score)


def _add_translate_train(actions: _Commands) -> None:
    """`attnlab translate train` (TranslateOptions; the None defaults depend on --train)."""
    text = (
        "train a Transformer on parallel text (resumable); without --train, a quick run of a "
        "small model on the bundled German-English sample"
    )
    train = _command(actions, "train", cmd_translate_train, text, _TRANSLATE)
    _add_run_flags(train, "output directory (a translation model)")
    train.add_argument("--train", nargs="+", metavar="FILE",
                       help="SRC TGT files or one SRC<TAB>TGT file (default: bundled de-en sample)")  # fmt: skip
    train.add_argument("--valid", nargs="+", metavar="FILE",
                       help="validation SRC TGT or TSV (default: hold out part of --train)")  # fmt: skip
    train.add_argument("--preset", help="transformer-small (default), -base or -big")
    train.add_argument("--tokenizer", help="BPE tokenizer directory instead of learning one")
    train.add_argument("--vocab-size", type=int, help="joint BPE vocabulary size (default 8000)")
    train.add_argument(
        "--max-tokens", type=int, help="padded tokens per batch (default 4096; sample 1024)"
    )
    train.add_argument("--steps", type=int, help="optimiser steps (default 100000; sample 400)")
    train.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this long")
    train.add_argument(
        "--warmup",
        type=int,
        help="warm-up steps (default 10%% of the steps, at most 4000; "
        "under --max-minutes, of the steps the time allows)",
    )
    train.add_argument("--grad-accum", type=int, help="batches per optimiser step")
    train.add_argument("--clip-norm", type=float, help="clip the gradient norm to this (0: none)")
    train.add_argument("--dropout", type=float, help="dropout (default: the preset's)")
    train.add_argument("--label-smoothing", type=float, help="epsilon_ls (default 0.1)")
    train.add_argument("--average-last", type=int, help="final model = mean of last N checkpoints")
    train.add_argument("--eval-every", type=int, help="steps between validations (default 1000)")
    train.add_argument("--eval-sentences", type=int, help="validation pairs scored by BLEU")
    train.add_argument("--eval-beam", type=int, help="beam for validation BLEU")


def _add_tokenizer_commands(commands: _Commands) -> _Commands:
    """`attnlab tokenizer train`; returns the group, whose choices build_parser names."""
    tok = commands.add_parser("tokenizer", help="tokenizer tools")
    tok_commands = tok.add_subparsers(dest="tokenizer_command", required=True, parser_class=_Parser)
    sub = _command(tok_commands, "train", cmd_tokenizer_train,
                   "train a WordPiece or BPE vocabulary")  # fmt: skip
    sub.add_argument("files", nargs="*", metavar="FILES", help="UTF-8 text files (.gz ok)")
    sub.add_argument("--corpus", nargs="+", help="more UTF-8 text files (.gz ok)")
    sub.add_argument(
        "--type",
        choices=("wordpiece", "bpe", "byte-bpe", "char"),
        default="wordpiece",
        help="wordpiece (BERT), bpe (joint translation vocabulary; TSV lines allowed), "
        "byte-bpe (GPT-2's byte-level BPE) or char (the corpus's characters)",
    )
    sub.add_argument(
        "--vocab-size", type=int, help="default 30522 (wordpiece), 8000 (bpe, byte-bpe)"
    )
    sub.add_argument("--cased", action="store_true", help="wordpiece: keep case and accents")
    sub.add_argument("--out", required=True)
    sub.add_argument("--overwrite", action="store_true")
    return tok_commands


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every attnlab command."""
    parser = _Parser(prog="attnlab", description="Transformer, BERT and GPT toolkit.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_info_and_tokenize(commands)
    _add_embed_and_export(commands)
    _add_pretrain(commands)
    _add_distill(commands)
    _add_finetune(commands)
    _add_evaluate_and_predict(commands)
    _add_translate_commands(commands)
    for family in COMMAND_FAMILIES:  # the newer command families, one module each
        importlib.import_module(f"attnlab.commands.{family}").add_commands(commands)
    tok_commands = _add_tokenizer_commands(commands)
    for group in (commands, tok_commands):
        # A missing command is named by its choices, as usage shows them, not by its dest
        group.metavar = "{" + ",".join(group.choices) + "}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; bad input, a refused file operation, no memory: one line on stderr, exit 2."""
    try:
        return _run(argv)
    finally:
        _leave_process_group()
        if argv is None and threading.current_thread() is threading.main_thread():
            # Run as the program: the command is over, and a Ctrl-C now would only break the
            # interpreter's shutdown (torch's exit handlers) with a traceback.
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _leave_process_group() -> None:
    """Leave torchrun's process group if the command joined one, whether it ended well or not."""
    # A process that exits with the group still up can abort in C++ as Python shuts down
    # (gloo's threads: "terminate called without an active exception", SIGABRT), and torchrun
    # then reports that abort, not the command's error, as the root cause.
    distributed = sys.modules.get("attnlab.train.distributed")  # not imported: no group
    if distributed is not None:
        distributed.shutdown_distributed()


def _run(argv: Sequence[str] | None) -> int:
    """main's body: the exit code of one command."""
    args = None
    try:
        if sys.stdout is None:  # the shell closed it (>&-): results would vanish
            raise AttnlabError("standard output is closed: results are printed there")
        args = build_parser().parse_args(argv)
        _set_threads(args)
        args.func(args)
    except AttnlabError as err:  # one line, whatever text (a file's, a label) it quotes
        message = err.worded(_flag_spelling(args))  # the library's option names as flags
        _say("attnlab: error: " + message.replace("\r", "\\r").replace("\n", "\\n"))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("attnlab: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except UnicodeEncodeError as err:
        _say(f"attnlab: error: {_unencodable(err)}")
        return EXIT_USAGE
    except OSError as err:  # the file system said no: a path through a file, no space, no access
        where = f": {err.filename}" if err.filename else ""
        _say(f"attnlab: error: {err.strerror or err}{where}")
        return EXIT_USAGE
    except (MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "can't allocate memory" not in str(err):
            raise  # a fault of attnlab's, not of the input: keep the traceback
        _say("attnlab: error: out of memory: the model or batch is too large for this machine")
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
