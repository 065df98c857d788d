"""Packed token streams for language modelling: a corpus tokenized once into one memory-mapped
array, and the fixed-length windows a model trains and is scored on.

A decoder-only LM reads its corpus as one stream of tokens (files joined end to end; with a
byte-level BPE an ``<|endoftext|>`` closes each file, as GPT-2's documents), from which it
trains on windows of ``seq_len + 1`` tokens at random offsets: the first ``seq_len`` are the
input and the last ``seq_len`` the targets (nanoGPT's ``get_batch``). The stream is cached in
``cache_dir/lm/<fingerprint>/`` (``tokens.bin`` + ``meta.json``), named, as the pretraining
cache of text/corpus_cache.py is, by everything that could change the ids: each file's path,
size and times, the tokenizer's full definition and the format. It is written under a scratch
name and renamed into place whole, so a killed build never leaves a cache a run would read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from attnlab.errors import AttnlabError
from attnlab.io import check_input_file, raise_for_target, text_pieces
from attnlab.text.corpus_cache import _file_key, _remove_dead_builds, _scratch_path
from attnlab.text.lm_tokenizer import BYTE_BPE, LMTokenizer

_STREAM_FORMAT = 1
_CHUNK_CHARS = 1 << 20  # characters tokenized at a time (the encodings are many times larger)
_SUBFOLDER = "lm"  # beside pretraining's caches in a shared cache_dir, never among them


class TokenStream:
    """A tokenized corpus as one memory-mapped array of ids (uint16 when the vocabulary fits)."""

    def __init__(self, directory: str | Path) -> None:
        """Map the ids of a cache directory written by ``build``."""
        self.directory = Path(directory)
        try:
            meta = json.loads((self.directory / "meta.json").read_text(encoding="utf-8"))
            length, dtype = int(meta["length"]), np.dtype(meta["dtype"])
            if meta["format"] != _STREAM_FORMAT or dtype not in (np.uint16, np.int32):
                raise ValueError("another format")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            raise AttnlabError(f"{self.directory} is not a token stream ({err})") from None
        path = self.directory / "tokens.bin"
        if not path.is_file() or path.stat().st_size != length * dtype.itemsize:
            raise AttnlabError(f"{path} is missing or is not the size meta.json gives")
        self.meta = meta
        self.tokens = np.memmap(path, dtype=dtype, mode="r", shape=(length,))

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def build(
        cls,
        files: Iterable[str | Path],
        tokenizer: LMTokenizer,
        cache_dir: str | Path,
        progress: bool = False,
    ) -> TokenStream:
        """Tokenize the files into cache_dir/lm/<fingerprint>/, or reuse that cache if present."""
        paths = [Path(f) for f in files]
        if not paths:
            raise AttnlabError("a token stream needs at least one text file")
        for path in paths:
            check_input_file(path, "corpus file")
        paths = [path.resolve() for path in paths]
        root = Path(cache_dir) / _SUBFOLDER
        target = root / _fingerprint([_file_key(p) for p in paths], tokenizer)
        if target.is_dir():
            try:
                stream = cls(target)
                stream.check_ids(tokenizer.vocab_size)
                return stream
            except AttnlabError as err:  # damaged since it was written: made again below
                print(f"warning: {err}: tokenizing the corpus again", file=sys.stderr)
        if root.exists() and not root.is_dir():
            raise AttnlabError(f"cache directory {root} is a file, not a directory")
        root.mkdir(parents=True, exist_ok=True)
        _remove_dead_builds(root)
        scratch = _scratch_path(root, target.name)
        try:
            scratch.mkdir()
            _write_stream(paths, tokenizer, scratch, progress)
            if target.is_dir():
                shutil.rmtree(target)
            try:
                os.rename(scratch, target)
            except OSError:
                if not (target / "meta.json").is_file():
                    raise
                shutil.rmtree(scratch)  # another process built the same stream first
        except BaseException as err:
            shutil.rmtree(scratch, ignore_errors=True)
            raise_for_target(err, scratch, target)
            raise
        return cls(target)

    def check_ids(self, vocab_size: int) -> None:
        """Raise AttnlabError unless every id is below vocab_size (a cache damaged on disk)."""
        for start in range(0, len(self.tokens), 1 << 24):
            if int(np.asarray(self.tokens[start : start + (1 << 24)]).max()) >= vocab_size:
                raise AttnlabError(
                    f"token stream {self.directory} is corrupt (an id outside the vocabulary)"
                )


def _fingerprint(file_keys: list[list[str | int]], tokenizer: LMTokenizer) -> str:
    """A name for the cache that changes whenever its ids could change."""
    definition = hashlib.sha256(tokenizer.backend.to_str().encode("utf-8")).hexdigest()
    key = {"format": _STREAM_FORMAT, "files": file_keys, "tokenizer": definition}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:20]


def text_chunks(
    path: Path, chunk_chars: int = _CHUNK_CHARS, exact_anywhere: bool = False
) -> Iterator[str]:
    """A file's text in chunks of about chunk_chars whose encodings joined equal the whole text's.

    A character tokenizer may cut anywhere (``exact_anywhere``). GPT-2's split regex may not:
    a cut inside a word or a run of spaces changes its pieces. A cut right after a line break
    that has a non-space on both sides ("x\\n|Y") is safe: the break is a piece of its own there
    either way. A text with no such place stays whole.
    """
    held: list[str] = []
    size, tail = 0, ""  # tail: the last two characters held
    for piece, _ in text_pieces(path, "corpus file "):
        if size >= chunk_chars and (exact_anywhere or _safe_cut(tail, piece)):
            yield "".join(held)
            held, size = [], 0
        held.append(piece)
        size += len(piece)
        tail = (tail + piece)[-2:]
    if held:
        yield "".join(held)


def _safe_cut(before: str, after: str) -> bool:
    """Whether text may be cut between before and after without changing GPT-2's pieces."""
    return (
        len(before) >= 2
        and before[-1] == "\n"
        and not before[-2].isspace()
        and bool(after)
        and not after[0].isspace()
    )


def _write_stream(paths: list[Path], tokenizer: LMTokenizer, out: Path, progress: bool) -> None:
    """Append each file's ids (and <|endoftext|> after it, for a byte-level BPE) to tokens.bin."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    length = 0
    with (
        open(out / "tokens.bin", "wb") as handle,
        tqdm(
            desc="tokenizing", unit=" chars", unit_scale=True, disable=not progress, delay=1.0
        ) as bar,
    ):
        for path in paths:
            exact = tokenizer.kind != BYTE_BPE
            batch: list[str] = []
            for chunk in text_chunks(path, exact_anywhere=exact):
                batch.append(chunk)
                if len(batch) == 8:  # encoded in parallel threads
                    length += _append(handle, tokenizer, batch, dtype, path)
                    bar.update(sum(map(len, batch)))
                    batch = []
            length += _append(handle, tokenizer, batch, dtype, path)
            bar.update(sum(map(len, batch)))
            if tokenizer.eos_id is not None:
                handle.write(np.asarray([tokenizer.eos_id], dtype).tobytes())
                length += 1
        handle.flush()
        os.fsync(handle.fileno())
    if length == 0 or (tokenizer.eos_id is not None and length == len(paths)):
        raise AttnlabError(f"corpus {', '.join(str(p) for p in paths)} has no text")
    meta = {"format": _STREAM_FORMAT, "length": length, "dtype": np.dtype(dtype).name,
            "files": [str(p) for p in paths], "kind": tokenizer.kind}  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _append(handle: Any, tokenizer: LMTokenizer, texts: list[str], dtype: type, path: Path) -> int:
    """Write the ids of texts to handle; how many."""
    if not texts:
        return 0
    ids = [i for encoded in tokenizer.encode_batch(texts, f"corpus file {path}") for i in encoded]
    handle.write(np.asarray(ids, dtype).tobytes())
    return len(ids)


def held_out_split(tokens: np.ndarray, share: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, held out): the stream's last ``share`` held out, as nanoGPT splits shakespeare."""
    cut = int(len(tokens) * (1 - share))
    return tokens[:cut], tokens[cut:]


def window_count(n_tokens: int, seq_len: int) -> int:
    """How many start offsets a stream of n_tokens has for a window of seq_len + 1 tokens."""
    return max(n_tokens - seq_len, 0)


class WindowBatches:
    """The LM BatchSource: each step ``batch_size`` windows at random offsets, from a seed.

    Step s draws its offsets from a generator seeded by (seed, s) alone, so a resumed run
    draws what an uninterrupted one does, and W ranks (each its rows of every micro-batch)
    read together what one process reads. The position is the number of steps read.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, batch_size: int, grad_accum: int = 1, seed: int = 0
    ) -> None:
        if window_count(len(tokens), seq_len) < 1:
            raise AttnlabError(
                f"the training text has {len(tokens)} tokens, too few for one window of seq_len "
                f"{seq_len} + 1: use a smaller seq_len or more text",
                options=("seq_len",),
            )
        if batch_size % grad_accum:
            raise AttnlabError(
                f"batch_size {batch_size} must be divisible by grad_accum {grad_accum}",
                options=("batch_size", "grad_accum"),
            )
        self.tokens, self.seq_len = tokens, seq_len
        self.batch_size, self.grad_accum, self.seed = batch_size, grad_accum, seed
        self.step = 0
        self.rank, self.world_size = 0, 1

    def set_rank(self, rank: int, world_size: int) -> None:
        """Take this rank's rows of every micro-batch."""
        if (self.batch_size // self.grad_accum) % world_size:
            raise AttnlabError(
                f"batch_size {self.batch_size} / grad_accum {self.grad_accum} must be divisible "
                f"by the {world_size} processes",
                options=("batch_size", "grad_accum"),
            )
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict[str, Any]:
        """The steps read so far."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a saved position."""
        self.step = int(state["step"])

    def offsets(self, step: int) -> np.ndarray:
        """The start of each window of a step's global batch."""
        generator = np.random.Generator(np.random.PCG64([self.seed, step]))
        return generator.integers(0, window_count(len(self.tokens), self.seq_len), self.batch_size)

    def windows(self, starts: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids and targets (the ids one further) of the windows at starts."""
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1]) for s in starts])
        rows = torch.from_numpy(rows.astype(np.int64))
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        micro = self.batch_size // self.grad_accum
        share = micro // self.world_size
        while True:
            starts = self.offsets(self.step)
            for m in range(self.grad_accum):
                mine = starts[m * micro + self.rank * share : m * micro + (self.rank + 1) * share]
                if m == self.grad_accum - 1:
                    self.step += 1  # the step is read once its last micro-batch is
                yield self.windows(mine)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens predicted in a batch (tokens/s)."""
        return batch["targets"].numel()


def evaluation_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive, non-overlapping windows over a held-out stream.

    Each window predicts ``length`` tokens, at most seq_len; together at most max_tokens
    (0: the whole stream). A stream shorter than one window is one window of its length.
    """
    length = min(seq_len, len(tokens) - 1)
    if length < 1:
        return []
    count = (len(tokens) - 1) // length
    if max_tokens > 0:
        count = max(1, min(count, max_tokens // length))
    return [(i * length, length) for i in range(count)]
