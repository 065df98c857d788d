"""BERT pretraining examples from plain text (Devlin et al. 2019, §3.1 and Appendix A.2).

The pipeline follows google-research/bert's `create_pretraining_data.py`: text is read as
documents of sentences, one sentence at a time, and tokenized once, in chunks, into
memory-mapped arrays (`TokenizedCorpus`, so a corpus larger than RAM trains, and a document
of any size costs no more memory than a small one), and `ExampleBuilder` turns each
document into `[CLS] A [SEP] B [SEP]` pairs with `create_instances_from_document`'s logic:
sentences are gathered into a chunk until a target length, A is a random prefix of the
chunk, and B is the rest (IsNext) or, half the time, text from another document (NotNext).
Two variants the notes name are built from the same corpus: RoBERTa's full sentences
without NSP (Liu et al. 2019, §4.2 "FULL-SENTENCES": packed across document ends) and
ALBERT's sentence-order prediction (Lan et al. 2020, §3.1). As google shuffles its
instances, an epoch's examples are mixed across documents (a shuffle buffer, so memory
stays bounded). Masking happens later, per batch, in `attnlab.text.masking`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import tokenizers
from tqdm import tqdm

from attnlab.errors import AttnlabError
from attnlab.io import raise_for_target, text_pieces
from attnlab.text.tokenizer import BertTokenizer

OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop")
IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, HF's convention (SOP: 0 = in order, 1 = swapped)
NO_LABEL = -1  # the label of an 'mlm' example, which has no sentence-level task

# Bumped whenever the cache layout or the tokenization rules change, so old caches miss.
_CACHE_FORMAT = 4  # 4: sentences cut at _MAX_SENTENCE_CHARS
# Sentences tokenized at a time, and most characters: a chunk costs at most this much
# (tokenizers' encodings take ~100 bytes a token), whatever the size of a document.
_CHUNK_SENTENCES = 10_000
_CHUNK_CHARS = 1 << 20
_PIECE_BYTES = 1 << 20  # a corpus line is read this many bytes at a time at most
# A "sentence" longer than this (text with no sentence end: a line of unpunctuated Chinese,
# a dump) is cut into pieces, at a space where there is one: held whole, a 32 MB line took
# 5 GB and 33 s to tokenize. A real sentence is far shorter, and an NSP/SOP segment keeps
# at most max_seq_len tokens of it anyway, so each piece serves as a sentence of its own.
_MAX_SENTENCE_CHARS = 4096
# Examples an epoch mixes at a time: a long document's examples spread over this many
# (google shuffles all instances of a run in memory; 10,000 of 128 tokens take ~8 MB).
_SHUFFLE_BUFFER = 10_000
_HELD_OUT_SEED = 20190524  # fixed: the held-out documents never depend on a run's --seed
_VERIFY_CHUNK = 1 << 24  # array elements read at a time when a reused cache is checked

# ---- sentences and documents -------------------------------------------------------------

# A run of sentence-final punctuation and the closing quotes or brackets that follow it.
_SENTENCE_END = re.compile(r"[.!?。！？；…]+[\"'”’»)）\]】」』》〉]*")
_CJK_FINAL = frozenset("。！？；…")
_EXCLAIMS = frozenset("!?")
_CJK_OR_FULL_WIDTH = re.compile(r"[\u3400-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")


def split_sentences(text: str) -> list[str]:
    """Split plain Chinese or English text into sentences, never returning empty strings."""
    return _LineSplitter().feed(text, ends_line=True)


class _LineSplitter:
    """split_sentences for a line that arrives in pieces, holding only its unfinished sentence."""

    def __init__(self) -> None:
        self.text = ""  # the line from the last sentence end on
        self.scan = 0  # where in text the next sentence-end search starts

    def feed(self, piece: str, ends_line: bool) -> list[str]:
        """The sentences that piece completes; at the line's end, the rest of the line too.

        A sentence longer than _MAX_SENTENCE_CHARS comes out in pieces no longer than that,
        so the text held between calls stays bounded too.
        """
        text = self.text + piece if self.text else piece
        scan, length = self.scan, len(text)
        sentences: list[str] = []
        start = 0
        # A search resumed where the last one stopped finds the same runs as one over the
        # whole line: the pattern looks at no text before a run.
        for match in _SENTENCE_END.finditer(text, scan):
            end = match.end()
            if end == length and not ends_line:  # the run may go on in the next piece
                scan = match.start()
                break
            scan = end
            following = text[end : end + 1]
            # Chinese full stops end a sentence wherever they stand; an English '.', '!' or
            # '?' only before a space or the end, so that 3.14 and U.S.A stay whole (and '!'
            # or '?' before a Chinese character too, as in 真的吗?是的).
            run = match.group()
            if (
                not following
                or following.isspace()
                or not _CJK_FINAL.isdisjoint(run)
                or (_CJK_OR_FULL_WIDTH.match(following) and not _EXCLAIMS.isdisjoint(run))
            ):
                _add_sentence(sentences, text, start, end)
                start = end
        else:
            scan = length
        if ends_line:
            _add_sentence(sentences, text, start, length)
            self.text, self.scan = "", 0
        else:
            # Up to scan no sentence ends: what exceeds the bound there can go now.
            held = _add_pieces(sentences, text, start, _cuts(text, start, scan))
            self.text, self.scan = text[held:], scan - held
        return sentences


def _cuts(text: str, start: int, end: int) -> list[int]:
    """Where to cut text[start:end] into pieces of at most _MAX_SENTENCE_CHARS (none if shorter).

    Each cut follows the last white space within the bound, so that words stay whole; text
    with no space there (Chinese) is cut at the bound. The last piece ends at ``end``.
    """
    ends = []
    while end - start > _MAX_SENTENCE_CHARS:
        space = max(text.rfind(c, start + 1, start + _MAX_SENTENCE_CHARS) for c in " \t\u3000")
        start = space + 1 if space > start else start + _MAX_SENTENCE_CHARS
        ends.append(start)
    return ends


def _add_sentence(sentences: list[str], text: str, start: int, end: int) -> None:
    """Append text[start:end], stripped, in pieces of at most _MAX_SENTENCE_CHARS (if not blank)."""
    _add_pieces(sentences, text, start, [*_cuts(text, start, end), end])


def _add_pieces(sentences: list[str], text: str, start: int, ends: list[int]) -> int:
    """Append the pieces text[start:ends[0]], text[ends[0]:ends[1]], ... that are not blank.

    Each stripped; returns the last end (start if ends is empty).
    """
    for end in ends:
        piece = text[start:end].strip()
        if piece:
            sentences.append(piece)
        start = end
    return start


def read_sentences(path: str | Path) -> Iterator[tuple[str, bool]]:
    """Yield the sentences of a UTF-8 text file (.gz too), each with whether it ends its document.

    The documents of `read_documents`, one sentence at a time: a document or line of any
    size costs only its sentence at hand (the file is read in pieces of _PIECE_BYTES).
    """
    path = Path(path)
    if not path.is_file():
        raise AttnlabError(f"corpus file {path} not found")
    blank_separated = _has_blank_separator(path)
    splitter = _LineSplitter()
    pending: str | None = None  # yielded once the next sentence or document end is known
    blank = True  # the line read so far holds only white space
    for piece, ends_line in _read_pieces(path):
        for sentence in splitter.feed(piece, ends_line):
            if pending is not None:
                yield pending, False
            pending = sentence
        blank = blank and (not piece or piece.isspace())
        if ends_line:
            # A blank line ends a document; without blank lines, so does every line.
            if pending is not None and (blank or not blank_separated):
                yield pending, True
                pending = None
            blank = True
    if pending is not None:
        yield pending, True


def read_documents(path: str | Path) -> Iterator[list[str]]:
    """Yield the documents of a UTF-8 text file (.gz too), each a list of sentences.

    With blank lines between documents (google-research/bert's layout) each line holds
    sentences of the current document; without them each non-empty line is one document.
    Lines pass through `split_sentences` in both layouts, which leaves a line holding one
    sentence as it is and splits paragraph lines (wikitext) into sentences.
    """
    document: list[str] = []
    for sentence, ends_document in read_sentences(path):
        document.append(sentence)
        if ends_document:
            yield document
            document = []


def _has_blank_separator(path: Path) -> bool:
    """Whether a blank line stands between two non-blank lines (a document separator)."""
    # Blank as read_documents (and google's line.strip()) sees it: a line of full-width
    # spaces (U+3000) or only a byte-order mark is blank too, which bytes.strip() missed.
    seen_text = seen_blank = False
    blank = True
    for piece, ends_line in _read_pieces(path):
        blank = blank and (not piece or piece.isspace())
        if not ends_line:
            continue
        if not blank:
            if seen_blank:
                return True
            seen_text = True
        elif seen_text:
            seen_blank = True
        blank = True
    return False


def _read_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """Yield the lines of a corpus file as text in bounded pieces (io.text_pieces)."""
    return text_pieces(path, "corpus file ", _PIECE_BYTES)


# ---- tokenized corpus ----------------------------------------------------------------------

# name -> dtype of each array file in a cache directory; lengths live in meta.json.
_ARRAYS = {
    "tokens": np.int32,
    "word_starts": np.uint8,
    "sentence_offsets": np.int64,
    "document_offsets": np.int64,
}


class TokenizedCorpus:
    """Token ids of a corpus in memory-mapped arrays, so a corpus larger than RAM trains."""

    tokens: np.ndarray  # int32 (n_tokens,): every sentence's WordPiece ids, no specials
    word_starts: np.ndarray  # uint8 (n_tokens,): 1 where a token starts a word
    sentence_offsets: np.ndarray  # int64 (n_sentences + 1,): sentence i is tokens[o[i]:o[i+1]]
    document_offsets: np.ndarray  # int64 (n_documents + 1,): indices into the sentences

    def __init__(self, directory: str | Path) -> None:
        """Map the arrays of a cache directory written by `build` (use `open`)."""
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as error:
            raise AttnlabError(
                f"{self.directory} is not a tokenized corpus (cannot read meta.json: {error})"
            ) from error
        if not isinstance(meta, dict) or meta.get("format") != _CACHE_FORMAT:
            raise AttnlabError(f"{meta_path} is not a tokenized corpus of format {_CACHE_FORMAT}")
        self.meta = meta
        lengths = meta.get("lengths")
        if not isinstance(lengths, dict):
            raise AttnlabError(f"{meta_path} lacks the arrays' lengths")
        for name, dtype in _ARRAYS.items():
            path = self.directory / f"{name}.bin"
            length = lengths.get(name)
            if not isinstance(length, int):
                raise AttnlabError(f"{meta_path} lacks the length of {name}")
            expected = length * np.dtype(dtype).itemsize
            if length < 0 or not path.is_file() or path.stat().st_size != expected:
                raise AttnlabError(f"{path} is missing or is not the size meta.json gives")
            setattr(self, name, np.memmap(path, dtype=dtype, mode="r", shape=(length,)))

    def verify(self, vocab_size: int) -> None:
        """Raise AttnlabError unless the arrays are consistent and every id is below vocab_size.

        A cache whose files have the right sizes but wrong bytes (a disk error, a file
        overwritten by hand) would otherwise fail mid-run with an IndexError or an embedding
        lookup out of range. One pass over the arrays, in chunks, so a corpus larger than RAM
        is read once from disk (33 ms for a 3.9M-token cache, 2-core Xeon).
        """

        def corrupt(detail: str) -> AttnlabError:
            return AttnlabError(f"corpus cache {self.directory} is corrupt ({detail})")

        for name, end in (
            ("sentence_offsets", self.n_tokens),
            ("document_offsets", self.n_sentences),
        ):
            offsets = getattr(self, name)
            if offsets[0] != 0 or offsets[-1] != end:
                raise corrupt(f"{name} does not run from 0 to {end}")
            for start in range(0, len(offsets) - 1, _VERIFY_CHUNK):
                chunk = np.asarray(offsets[start : start + _VERIFY_CHUNK + 1])
                if np.any(chunk[1:] <= chunk[:-1]):
                    raise corrupt(f"{name} is not increasing")
        for start in range(0, self.n_tokens, _VERIFY_CHUNK):
            ids = np.asarray(self.tokens[start : start + _VERIFY_CHUNK])
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise corrupt(f"a token id outside the vocabulary of {vocab_size}")
            if np.asarray(self.word_starts[start : start + _VERIFY_CHUNK]).max() > 1:
                raise corrupt("a word-start flag other than 0 or 1")

    @classmethod
    def open(cls, directory: str | Path) -> TokenizedCorpus:
        """Open a corpus cache directory written by `build`."""
        return cls(directory)

    @classmethod
    def build(
        cls,
        files: list[str | Path],
        tokenizer: BertTokenizer,
        cache_dir: str | Path,
        chinese_words: bool = False,
        progress: bool = False,
    ) -> TokenizedCorpus:
        """Tokenize text files into cache_dir/<fingerprint>/, or reuse that cache if present.

        The fingerprint covers each file's absolute path, size, modification time and inode
        change time (which no call sets back), the vocabulary and normalisation of
        `tokenizer`, and `chinese_words`. With `chinese_words` a Chinese character starts a
        word only where jieba's segmentation starts one, for whole-word masking of Chinese
        (Cui et al. 2021, BERT-wwm). A build that tokenizes also removes the caches in
        cache_dir that no build can ask for again: of an older format, or of a file that has
        changed or gone since.
        """
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise AttnlabError("a tokenized corpus needs at least one text file")
        paths = [path.resolve() for path in paths]
        for path in paths:
            if not path.is_file():
                raise AttnlabError(f"corpus file {path} not found")
        file_keys = [_file_key(path) for path in paths]
        cache_root = Path(cache_dir)
        target = cache_root / _fingerprint(file_keys, tokenizer, chinese_words)
        damaged = target.exists()  # built caches are renamed into place whole
        if damaged:
            try:
                corpus = cls(target)
                corpus.verify(tokenizer.vocab_size)
                return corpus
            except AttnlabError as err:  # damaged since it was written: made again below
                print(f"warning: {err}: tokenizing the corpus again", file=sys.stderr)
        segmenter = _Jieba() if chinese_words else None

        if cache_root.exists() and not cache_root.is_dir():  # mkdir would say "File exists"
            raise AttnlabError(f"cache directory {cache_root} is a file, not a directory")
        cache_root.mkdir(parents=True, exist_ok=True)
        _remove_dead_builds(cache_root)
        # Before tokenizing, so that an edited corpus's old cache makes room for its new one:
        # what is removed can never be served again, so a build that fails loses nothing.
        _remove_stale_caches(cache_root, keep=target)
        # Built under a temporary name and renamed, so a crash or a concurrent build never
        # leaves a half-written cache where `open` would find it.
        scratch = cache_root / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            scratch.mkdir()  # in the try: a read-only cache refuses it, naming the scratch
            _write_corpus(paths, file_keys, tokenizer, segmenter, scratch, progress)
            if damaged and target.is_dir():
                shutil.rmtree(target)
            try:
                os.rename(scratch, target)
            except OSError:
                if not (target / "meta.json").is_file():
                    raise
                shutil.rmtree(scratch)  # another process built the same cache first
        except BaseException as err:
            shutil.rmtree(scratch, ignore_errors=True)
            raise_for_target(err, scratch, target)  # a full disk: closing a file names none
            raise
        return cls(target)

    # ---- access ----------------------------------------------------------------------------

    @property
    def n_documents(self) -> int:
        """Number of documents."""
        return len(self.document_offsets) - 1

    @property
    def n_sentences(self) -> int:
        """Number of sentences."""
        return len(self.sentence_offsets) - 1

    @property
    def n_tokens(self) -> int:
        """Number of tokens."""
        return len(self.tokens)

    def sentence(self, i: int) -> np.ndarray:
        """Token ids of sentence `i` (a read-only view)."""
        return self.tokens[self.sentence_offsets[i] : self.sentence_offsets[i + 1]]

    def sentence_word_starts(self, i: int) -> np.ndarray:
        """Word-start flags of sentence `i`."""
        return self.word_starts[self.sentence_offsets[i] : self.sentence_offsets[i + 1]]

    def sentence_ids(self, document: int) -> range:
        """Indices of the sentences of `document`."""
        return range(int(self.document_offsets[document]), int(self.document_offsets[document + 1]))

    def document(self, i: int) -> list[np.ndarray]:
        """Token ids of each sentence of document `i`."""
        return [self.sentence(s) for s in self.sentence_ids(i)]

    def split(self, eval_documents: int) -> tuple[CorpusView, CorpusView]:
        """Hold out `eval_documents` documents drawn at random: (train view, eval view).

        Drawn from the whole corpus, so that with several files (say reviews, then headlines)
        the held-out set is not the last file's alone; by a fixed seed, so that it stays the
        same whatever the training run's seed and settings.
        """
        if not 0 <= eval_documents < self.n_documents:
            raise AttnlabError(
                f"cannot hold out {eval_documents} of {self.n_documents} documents: "
                "keep at least one for training"
            )
        order = np.random.Generator(np.random.PCG64(_HELD_OUT_SEED)).permutation(self.n_documents)
        held_out = np.sort(order[:eval_documents]).astype(np.int64)
        train = np.sort(order[eval_documents:]).astype(np.int64)
        return CorpusView(self, train), CorpusView(self, held_out)

    def __getstate__(self) -> dict:
        # Pickled for DataLoader workers: ship the directory, not the mapped arrays (which
        # pickle as full in-memory copies).
        return {"directory": str(self.directory)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"])

    def __repr__(self) -> str:
        return (
            f"TokenizedCorpus({str(self.directory)!r}, documents={self.n_documents}, "
            f"sentences={self.n_sentences}, tokens={self.n_tokens})"
        )


class CorpusView:
    """A subset of a corpus's documents, with the same document API."""

    def __init__(self, corpus: TokenizedCorpus, documents: np.ndarray) -> None:
        """View the documents of `corpus` whose indices are in `documents`."""
        self.corpus = corpus
        self.documents = np.asarray(documents, dtype=np.int64)

    @property
    def n_documents(self) -> int:
        """Number of documents in the view."""
        return len(self.documents)

    @property
    def n_sentences(self) -> int:
        """Number of sentences in the view."""
        offsets = self.corpus.document_offsets
        return int(np.sum(offsets[self.documents + 1] - offsets[self.documents]))

    @property
    def n_tokens(self) -> int:
        """Number of tokens in the view."""
        sentences = self.corpus.sentence_offsets
        documents = self.corpus.document_offsets
        first = sentences[documents[self.documents]]
        last = sentences[documents[self.documents + 1]]
        return int(np.sum(last - first))

    def sentence_ids(self, document: int) -> range:
        """Indices (into the whole corpus) of the sentences of the view's `document`."""
        return self.corpus.sentence_ids(int(self.documents[document]))

    def document(self, i: int) -> list[np.ndarray]:
        """Token ids of each sentence of the view's document `i`."""
        return self.corpus.document(int(self.documents[i]))

    def __repr__(self) -> str:
        return f"CorpusView({self.corpus!r}, documents={self.n_documents})"


def _remove_dead_builds(cache_root: Path) -> None:
    """Delete the scratch folders of builds whose process is gone (killed mid-tokenizing)."""
    for scratch in cache_root.glob(".*.*.*.tmp"):
        try:
            pid = int(scratch.name.split(".")[2])
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(scratch, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue  # not a name of ours, or another user's live process


def _remove_stale_caches(cache_root: Path, keep: Path) -> None:
    """Delete the caches in cache_root that no build can ask for again, saying so on stderr."""
    removed, size = 0, 0
    # Only the names _fingerprint gives: the scratch folders of live builds are dot-names.
    for cache in cache_root.glob("[0-9a-f]" * 20):
        if cache.name == keep.name or cache.is_symlink() or not cache.is_dir():
            continue
        try:
            meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
            form = meta["format"]
            # A newer format may be another attnlab's that shares the folder.
            if type(form) is not int or form > _CACHE_FORMAT:
                continue
            if form == _CACHE_FORMAT and not any(map(_file_changed, meta["file_keys"])):
                continue  # the same files, tokenized for another vocabulary
        except (OSError, ValueError, TypeError, KeyError, RecursionError):
            continue  # not clearly one of ours (or format 4 without file keys): left alone
        # Renamed first, as a scratch folder of this process: a reader sees it whole or not at
        # all, and if this process dies mid-delete, _remove_dead_builds finishes the job. A
        # run that has the arrays mapped keeps reading them (unlinked files live on).
        doomed = cache_root / f".{cache.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            os.rename(cache, doomed)
            freed = sum(entry.lstat().st_size for entry in doomed.iterdir())
            shutil.rmtree(doomed)
        except OSError:
            continue  # another process removed it first, or this user may not
        removed, size = removed + 1, size + freed
    if removed:
        print(
            f"note: removed {removed} corpus cache{'s' if removed > 1 else ''} that no run "
            f"can use again ({size / 1e9:.1f} GB) from {cache_root}",
            file=sys.stderr,
        )


def _file_changed(key: list[str | int]) -> bool:
    """Whether the corpus file a cache recorded with `_file_key` has changed or gone since."""
    if not (
        isinstance(key, list)
        and len(key) == 4
        and isinstance(key[0], str)
        and os.path.isabs(key[0])
        and all(type(number) is int for number in key[1:])
    ):
        raise ValueError(f"not a file key: {key!r}")
    try:
        # A changed key is for good: no call sets the inode change time back.
        return _file_key(Path(key[0])) != key
    except (FileNotFoundError, NotADirectoryError):
        return True


def _fingerprint(
    file_keys: list[list[str | int]], tokenizer: BertTokenizer, chinese_words: bool
) -> str:
    """A name for the cache that changes whenever the tokenized arrays could change."""
    vocab = tokenizer.vocab
    tokens_in_id_order = "\n".join(sorted(vocab, key=vocab.__getitem__))
    key = {
        "format": _CACHE_FORMAT,
        "files": file_keys,
        "vocab_sha256": hashlib.sha256(tokens_in_id_order.encode("utf-8")).hexdigest(),
        "lowercase": tokenizer.lowercase,
        "strip_accents": tokenizer.strip_accents,
        "tokenize_chinese_chars": tokenizer.tokenize_chinese_chars,
        "chinese_words": chinese_words,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:20]


def _file_key(path: Path) -> list[str | int]:
    """What tells a changed corpus file: path, size, modification and inode change times."""
    # The change time too: an edit that keeps the size and sets the modification time back
    # (os.utime, cp -p, rsync -t, tar x) served the old tokens; no call sets it back.
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


class _Jieba:
    """jieba's segmenter, imported at the first text with an ideograph (English needs none)."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None

    def tokenize(self, text: str) -> Iterator[tuple[str, int, int]]:
        """jieba.tokenize(text): (word, start, end) of each word."""
        if self.module is None:
            try:
                import jieba
            except ImportError as error:
                raise AttnlabError(
                    "whole-word masking of Chinese text needs the jieba package for word "
                    "segmentation: pip install jieba"
                ) from error
            import logging

            jieba.setLogLevel(logging.WARNING)  # silence its "Building prefix dict" chatter
            self.module = jieba
        return self.module.tokenize(text)


def _encode_chunk(tokenizer: BertTokenizer, sentences: list[str]) -> list[tokenizers.Encoding]:
    """WordPiece encodings of sentences, without specials or truncation."""
    # The untruncated backend: a pretraining sentence longer than the model's max_length
    # is cut later, by the example builder, not dropped here.
    return tokenizer.backend.encode_batch(sentences, add_special_tokens=False)


def _write_corpus(
    paths: list[Path],
    file_keys: list[list[str | int]],
    tokenizer: BertTokenizer,
    segmenter: _Jieba | None,
    out: Path,
    progress: bool,
) -> None:
    """Stream sentences through the tokenizer in bounded chunks, appending to the array files."""
    writer = _CorpusWriter(out, tokenizer, segmenter)
    # Shown only once tokenizing has taken a second: a small corpus prints no bar (nor one
    # before the error line of a corpus refused right after).
    with tqdm(desc="tokenizing", unit=" sentences", disable=not progress, delay=1.0) as bar:
        try:
            sentences: list[str] = []
            ends_document: list[bool] = []  # True for the last sentence of each document
            chars = 0
            for path in paths:
                for sentence, last in read_sentences(path):
                    sentences.append(sentence)
                    ends_document.append(last)
                    chars += len(sentence)
                    if len(sentences) >= _CHUNK_SENTENCES or chars >= _CHUNK_CHARS:
                        writer.write(sentences, ends_document)
                        bar.update(len(sentences))
                        sentences, ends_document, chars = [], [], 0
            if sentences:
                writer.write(sentences, ends_document)
                bar.update(len(sentences))
            writer.finish()
        finally:
            writer.close()
    if writer.n_sentences == 0:
        names = ", ".join(str(path) for path in paths)
        raise AttnlabError(f"corpus {names} has no text")
    meta = {
        "format": _CACHE_FORMAT,
        "files": [str(path) for path in paths],
        # The keys the cache's name was made from: a later build tells by them, without the
        # vocabulary, that no build can ask for this cache again once a file has changed.
        "file_keys": file_keys,
        "lengths": {
            "tokens": writer.n_tokens,
            "word_starts": writer.n_tokens,
            "sentence_offsets": writer.n_sentences + 1,
            "document_offsets": writer.n_documents + 1,
        },
        "chinese_words": segmenter is not None,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


class _CorpusWriter:
    """Appends tokenized chunks of sentences to the array files of a cache directory."""

    def __init__(self, out: Path, tokenizer: BertTokenizer, segmenter: _Jieba | None) -> None:
        """Create the array files in `out`, each offsets file starting with its 0."""
        self.tokenizer = tokenizer
        self.segmenter = segmenter
        self.continuation = np.zeros(tokenizer.vocab_size, dtype=bool)
        for token, token_id in tokenizer.vocab.items():
            self.continuation[token_id] = token.startswith("##")
        self.handles = {name: open(out / f"{name}.bin", "wb") for name in _ARRAYS}  # noqa: SIM115
        self.handles["sentence_offsets"].write(np.zeros(1, np.int64).tobytes())
        self.handles["document_offsets"].write(np.zeros(1, np.int64).tobytes())
        self.n_tokens = self.n_sentences = self.n_documents = 0
        self.sentences_at_document_end = 0

    def write(self, sentences: list[str], ends_document: list[bool]) -> None:
        """Tokenize a chunk of sentences and append them; `ends_document` marks each document's last."""
        token_arrays, start_arrays = [], []
        sentence_ends, document_ends = [], []
        encodings = _encode_chunk(self.tokenizer, sentences)
        for text, encoding, last in zip(sentences, encodings, ends_document, strict=True):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            # A sentence of only control characters tokenizes to nothing: drop it.
            if len(ids):
                starts = ~self.continuation[ids]
                if self.segmenter is not None:
                    starts = _chinese_word_starts(self.segmenter, text, encoding.offsets, starts)
                token_arrays.append(ids)
                start_arrays.append(starts.astype(np.uint8))
                self.n_tokens += len(ids)
                self.n_sentences += 1
                sentence_ends.append(self.n_tokens)
            # Documents left without sentences are dropped, as google-research/bert does.
            if last and self.n_sentences > self.sentences_at_document_end:
                self.sentences_at_document_end = self.n_sentences
                document_ends.append(self.n_sentences)
        if token_arrays:
            self.handles["tokens"].write(np.concatenate(token_arrays).tobytes())
            self.handles["word_starts"].write(np.concatenate(start_arrays).tobytes())
            self.handles["sentence_offsets"].write(np.asarray(sentence_ends, np.int64).tobytes())
        if document_ends:
            self.handles["document_offsets"].write(np.asarray(document_ends, np.int64).tobytes())
            self.n_documents += len(document_ends)

    def finish(self) -> None:
        """Flush the files to disk before the cache directory is renamed into place."""
        for handle in self.handles.values():
            handle.flush()
            os.fsync(handle.fileno())

    def close(self) -> None:
        """Close the files."""
        for handle in self.handles.values():
            handle.close()


# The ranges of _is_cjk, for a fast test of a whole sentence.
_IDEOGRAPH = re.compile(
    "[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
    "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\uf900-\ufaff\U0002f800-\U0002fa1f]"
)


def _is_cjk(char: str) -> bool:
    """Whether `char` is a CJK ideograph (the ranges BERT's tokenizer splits one per token)."""
    code = ord(char)
    return (
        0x4E00 <= code <= 0x9FFF
        or 0x3400 <= code <= 0x4DBF
        or 0x20000 <= code <= 0x2A6DF
        or 0x2A700 <= code <= 0x2B73F
        or 0x2B740 <= code <= 0x2B81F
        or 0x2B820 <= code <= 0x2CEAF
        or 0xF900 <= code <= 0xFAFF
        or 0x2F800 <= code <= 0x2FA1F
    )


def _chinese_word_starts(
    segmenter: _Jieba, text: str, offsets: list[tuple[int, int]], starts: np.ndarray
) -> np.ndarray:
    """Word starts where each Chinese character starts a word only at a jieba word's start."""
    # WordPiece makes every ideograph a word of its own; jieba's segmentation joins them
    # back into words (BERT-wwm), while other tokens keep the '##' rule. jieba only joins:
    # a '##' piece (an ideograph inside a WordPiece word, as with tokenize_chinese_chars
    # off) stays inside its word even where jieba starts one.
    if not _IDEOGRAPH.search(text):  # nothing for jieba to join (and no jieba needed)
        return starts
    jieba_starts = {start for _, start, _ in segmenter.tokenize(text)}
    starts = starts.copy()
    for k, (begin, _) in enumerate(offsets):
        if starts[k] and begin < len(text) and _is_cjk(text[begin]):
            starts[k] = begin in jieba_starts
    return starts


# ---- examples ------------------------------------------------------------------------------


@dataclass
class Example:
    """One pretraining input: [CLS] A [SEP] B [SEP], or [CLS] A [SEP] for 'mlm'."""

    input_ids: np.ndarray  # int32 (seq,)
    token_type_ids: np.ndarray  # int8 (seq,): 0 for [CLS] A [SEP], 1 for B [SEP]
    word_starts: np.ndarray  # bool (seq,): specials and each segment's first token count as starts
    label: int  # NSP: 0 IsNext, 1 NotNext; SOP: 0 in order, 1 swapped; -1 for 'mlm'


# A segment under construction: token ids and word-start flags, concatenated sentences.
_Segment = tuple[np.ndarray, np.ndarray]


class ExampleBuilder:
    """Turns a tokenized corpus into pretraining examples, one reproducible pass per epoch."""

    def __init__(
        self,
        corpus: TokenizedCorpus | CorpusView,
        cls_id: int,
        sep_id: int,
        max_seq_len: int = 128,
        objective: str = "mlm+nsp",
        short_seq_prob: float = 0.1,
        seed: int = 0,
    ) -> None:
        """Build examples of at most `max_seq_len` tokens for `objective` (see OBJECTIVES)."""
        if objective not in OBJECTIVES:
            raise AttnlabError(
                f"unknown pretraining objective {objective!r}: choose one of {', '.join(OBJECTIVES)}"
            )
        minimum = 3 if objective == "mlm" else 5  # room for the specials and 1 token a segment
        if not isinstance(max_seq_len, int) or max_seq_len < minimum:
            raise AttnlabError(
                f"max_seq_len must be an integer >= {minimum} for {objective}, got {max_seq_len!r}"
            )
        if not 0.0 <= short_seq_prob <= 1.0:
            raise AttnlabError(f"short_seq_prob must lie in [0, 1], got {short_seq_prob}")
        if corpus.n_documents == 0:
            raise AttnlabError("the corpus has no documents")
        if objective == "mlm+nsp" and corpus.n_documents < 2:
            raise AttnlabError(
                "the corpus has a single document (a blank line ends one): next-sentence "
                "prediction needs at least two (use --objective mlm)"
            )
        self.corpus = corpus
        self._base = corpus.corpus if isinstance(corpus, CorpusView) else corpus
        self.cls_id, self.sep_id = cls_id, sep_id
        self.max_seq_len = max_seq_len
        self.objective = objective
        self.short_seq_prob = short_seq_prob
        self.seed = seed

    def epoch(self, epoch: int) -> Iterator[Example]:
        """Yield one epoch's examples, the same for the same (seed, epoch)."""
        # A generator per (seed, epoch) rather than one carried across epochs: resuming at
        # epoch k needs no replay of epochs 0..k-1.
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        documents = (int(d) for d in rng.permutation(self.corpus.n_documents))
        if self.objective == "mlm":
            examples = self._full_sentences(documents)
        else:
            examples = (e for d in documents for e in self._pair_examples(d, rng))
        # Without mixing, a document's examples would follow one another, and a long one
        # would fill whole batches with one topic.
        shuffle = np.random.Generator(np.random.PCG64([self.seed, epoch, 1]))
        yield from _shuffled(examples, _SHUFFLE_BUFFER, shuffle, self.max_seq_len)

    def count_epoch(self, epoch: int) -> int:
        """Number of examples `epoch(epoch)` yields (a full pass over the corpus)."""
        return sum(1 for _ in self.epoch(epoch))

    # ---- RoBERTa: full sentences, no sentence-level task -------------------------------------

    def _full_sentences(self, documents: Iterator[int]) -> Iterator[Example]:
        """Pack whole sentences into [CLS] text [SEP] up to max_seq_len, across documents.

        RoBERTa's FULL-SENTENCES: at a document's end packing goes on with the next one,
        after an extra [SEP]; so every example but the epoch's last is nearly full, where
        stopping at each document's end (DOC-SENTENCES) left short documents' examples
        mostly padding. A sentence longer than the budget is cut into budget-sized pieces
        that pack like sentences.
        """
        budget = self.max_seq_len - 2
        current: list[tuple[int, int] | None] = []  # token spans; None: a document separator
        length = 0
        for document in documents:
            if current and length < budget:
                current.append(None)
                length += 1
            for sentence in self.corpus.sentence_ids(document):
                start, end = self._span(sentence)
                for piece in range(start, end, budget):
                    size = min(piece + budget, end) - piece
                    if current and length + size > budget:
                        yield self._packed(current)
                        current, length = [], 0
                    current.append((piece, piece + size))
                    length += size
        if current:
            yield self._packed(current)

    def _packed(self, spans: list[tuple[int, int] | None]) -> Example:
        """[CLS] text [SEP] of token spans, None giving a [SEP] between documents."""
        while spans and spans[-1] is None:  # a separator with nothing after it
            spans = spans[:-1]
        return self._example(self._concat(spans), None, NO_LABEL)

    # ---- BERT (NSP) and ALBERT (SOP): segment pairs ------------------------------------------

    def _pair_examples(self, document: int, rng: np.random.Generator) -> Iterator[Example]:
        """google-research/bert's create_instances_from_document (SOP: see _sop_pair)."""
        # A range, each span read when its sentence joins a chunk: a list of the document's
        # spans cost ~120 bytes a sentence, 120 MB for a document of a million.
        sentences = self.corpus.sentence_ids(document)
        max_tokens = self.max_seq_len - 3  # room for [CLS], [SEP], [SEP]
        # Mostly full-length sequences; sometimes shorter ones, so that pretraining also
        # sees the short inputs of fine-tuning.
        target = max_tokens
        if rng.random() < self.short_seq_prob:
            target = int(rng.integers(2, max_tokens + 1))

        chunk: list[tuple[int, int]] = []
        length = 0
        i = 0
        while i < len(sentences):
            span = self._span(sentences[i])
            chunk.append(span)  # at most target sentences: each holds a token
            length += span[1] - span[0]
            if i == len(sentences) - 1 or length >= target:
                a_end = 1 if len(chunk) < 2 else int(rng.integers(1, len(chunk)))
                if self.objective == "mlm+nsp":
                    a, b, label, unused = self._nsp_pair(document, chunk, a_end, target, rng)
                    i -= unused  # google puts the sentences of a NotNext B's place back
                else:
                    pair = self._sop_pair(chunk, a_end, rng)
                    a, b, label = pair if pair is not None else (None, None, NO_LABEL)
                if a is not None:
                    a, b = _truncate_pair(a, b, max_tokens, rng)
                    yield self._example(a, b, label)
                chunk, length = [], 0
            i += 1

    def _nsp_pair(
        self,
        document: int,
        chunk: list[tuple[int, int]],
        a_end: int,
        target: int,
        rng: np.random.Generator,
    ) -> tuple[_Segment, _Segment, int, int]:
        """A and B for NSP, the label, and how many chunk sentences go back unused."""
        a = self._concat(chunk[:a_end])
        # A one-sentence chunk has no true B, so google always makes it NotNext.
        if len(chunk) > 1 and rng.random() >= 0.5:
            return a, self._concat(chunk[a_end:]), IS_NEXT, 0
        # Any document but this one; google tries 10 random draws and may still land on
        # the same document in a small corpus, which would mislabel the pair.
        other = int(rng.integers(0, self.corpus.n_documents - 1))
        other += other >= document
        other_sentences = self.corpus.sentence_ids(other)
        first = int(rng.integers(0, len(other_sentences)))
        b_target = target - len(a[0])
        b_spans, b_length = [], 0
        for sentence in other_sentences[first:]:
            span = self._span(sentence)
            b_spans.append(span)
            b_length += span[1] - span[0]
            if b_length >= b_target:
                break
        return a, self._concat(b_spans), NOT_NEXT, len(chunk) - a_end

    def _sop_pair(
        self, chunk: list[tuple[int, int]], a_end: int, rng: np.random.Generator
    ) -> tuple[_Segment, _Segment, int] | None:
        """Two consecutive segments of one document, swapped half the time (label 1).

        A deliberate departure from ALBERT's code, which pairs a one-sentence chunk with
        another document's text (labelled swapped): here the sentence is cut at a random
        token instead, so every pair is in-document, as the paper's SOP is defined.
        """
        if len(chunk) > 1:
            a, b = self._concat(chunk[:a_end]), self._concat(chunk[a_end:])
        else:
            # A lone sentence (a one-sentence document, or one longer than the target)
            # still gives two consecutive segments when cut at a random token.
            start, end = chunk[0]
            if end - start < 2:
                return None
            cut = int(rng.integers(start + 1, end))
            a, b = self._concat([(start, cut)]), self._concat([(cut, end)])
        if rng.random() < 0.5:
            return b, a, 1
        return a, b, 0

    # ---- assembly -------------------------------------------------------------------------

    def _span(self, sentence: int) -> tuple[int, int]:
        """Token range of a sentence in the corpus arrays."""
        offsets = self._base.sentence_offsets
        return int(offsets[sentence]), int(offsets[sentence + 1])

    def _concat(self, spans: list[tuple[int, int] | None]) -> _Segment:
        """Token ids and word starts of spans, joined; None stands for a [SEP] (a word start)."""
        tokens, starts = self._base.tokens, self._base.word_starts
        sep, true = np.array([self.sep_id], dtype=tokens.dtype), np.ones(1, dtype=bool)
        ids = np.concatenate([sep if span is None else tokens[span[0] : span[1]] for span in spans])
        flags = [true if span is None else starts[span[0] : span[1]] for span in spans]
        return ids, np.concatenate(flags).astype(bool)

    def _example(self, a: _Segment, b: _Segment | None, label: int) -> Example:
        """[CLS] A [SEP] (B [SEP]) with segment ids and word starts."""
        cls = np.array([self.cls_id], dtype=np.int32)
        sep = np.array([self.sep_id], dtype=np.int32)
        true = np.ones(1, dtype=bool)
        a_starts = a[1].copy()
        # A segment cut mid-word (truncation, a split sentence) begins a word of its own.
        a_starts[0] = True
        ids = [cls, a[0].astype(np.int32), sep]
        starts = [true, a_starts, true]
        types = [np.zeros(len(a[0]) + 2, dtype=np.int8)]
        if b is not None:
            b_starts = b[1].copy()
            b_starts[0] = True
            ids += [b[0].astype(np.int32), sep]
            starts += [b_starts, true]
            types.append(np.ones(len(b[0]) + 1, dtype=np.int8))
        return Example(
            input_ids=np.concatenate(ids),
            token_type_ids=np.concatenate(types),
            word_starts=np.concatenate(starts),
            label=label,
        )


class _Slots:
    """A shuffle buffer's examples, kept in arrays allocated once rather than one object each.

    Thousands of small per-example arrays, each held for hundreds of steps, are scattered
    through the heap among a training step's large temporaries. With one object per example,
    HF's BertForPreTraining in bench/pretrain_quality.py (bert-mini, Chinese corpus, one
    thread) grew by 6.5 MB a step (steps 80-290); with these slots 0.9 MB (steps 132-462), the
    two runs side by side, 2026-12-02. A slot is copied out when drawn, so what the consumer
    holds is short-lived; the examples and their order are unchanged.
    """

    def __init__(self, size: int, max_len: int) -> None:
        self.ids = np.zeros((size, max_len), dtype=np.int32)
        self.types = np.zeros((size, max_len), dtype=np.int8)
        self.starts = np.zeros((size, max_len), dtype=bool)
        self.lengths = np.zeros(size, dtype=np.int64)
        self.labels = np.zeros(size, dtype=np.int64)

    def put(self, slot: int, example: Example) -> None:
        """Store example in slot (the slot's previous example is gone)."""
        n = len(example.input_ids)
        self.ids[slot, :n] = example.input_ids
        self.types[slot, :n] = example.token_type_ids
        self.starts[slot, :n] = example.word_starts
        self.lengths[slot], self.labels[slot] = n, example.label

    def get(self, slot: int) -> Example:
        """A copy of the example in slot."""
        n = int(self.lengths[slot])
        return Example(
            input_ids=self.ids[slot, :n].copy(),
            token_type_ids=self.types[slot, :n].copy(),
            word_starts=self.starts[slot, :n].copy(),
            label=int(self.labels[slot]),
        )


def _shuffled(
    items: Iterator[Example], size: int, rng: np.random.Generator, max_len: int
) -> Iterator[Example]:
    """items in a random order drawn from a buffer of `size` (a full shuffle if they fit)."""
    slots = _Slots(size, max_len)
    filled = 0
    for item in items:
        if filled < size:
            slots.put(filled, item)
            filled += 1
            continue
        slot = int(rng.integers(size))
        yield slots.get(slot)
        slots.put(slot, item)
    for slot in rng.permutation(filled):
        yield slots.get(int(slot))


def _truncate_pair(
    a: _Segment, b: _Segment, max_tokens: int, rng: np.random.Generator
) -> tuple[_Segment, _Segment]:
    """google-research/bert's truncate_seq_pair in closed form: trim to max_tokens in all."""
    # google removes one token at a time from the longer segment (B on a tie), each from
    # the front or the back with probability 1/2. The lengths that loop ends with are
    # computed directly, and the front cuts of each side drawn as one binomial, which is
    # the same distribution without a loop as long as a very long sentence.
    la, lb = len(a[0]), len(b[0])
    if la + lb <= max_tokens:
        return a, b
    short = min(la, lb)
    if max_tokens - short >= short:  # only the longer side is cut
        new_a, new_b = (max_tokens - lb, lb) if la > lb else (la, max_tokens - la)
    else:  # both are cut, ending within one token of each other (A the longer)
        new_a, new_b = (max_tokens + 1) // 2, max_tokens // 2
    return _trim(a, la - new_a, rng), _trim(b, lb - new_b, rng)


def _trim(segment: _Segment, remove: int, rng: np.random.Generator) -> _Segment:
    """Remove `remove` tokens, each from the front or the back with probability 1/2."""
    if remove == 0:
        return segment
    front = int(rng.binomial(remove, 0.5))
    end = len(segment[0]) - (remove - front)
    return segment[0][front:end], segment[1][front:end]
