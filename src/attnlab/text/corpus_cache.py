"""The tokenized corpus cache: a pretraining corpus's token ids in memory-mapped arrays.

A corpus is tokenized once, in bounded chunks of sentences (attnlab.text.sentences), into flat
arrays on disk: token ids, word-start flags, sentence and document offsets. `TokenizedCorpus`
maps them, so a corpus larger than RAM trains and a document of any size costs no more memory
than a small one. A cache lives in cache_dir/<fingerprint>/, named by all that could change its
arrays (the files, the vocabulary and normalisation, `_CACHE_FORMAT`), so a run reuses a cache
exactly when it would build the same one. A build is written under a scratch name and renamed
into place whole, and a build that tokenizes first removes the caches no build can ask for
again (an older format, or a corpus file changed or gone since).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
import tokenizers
from tqdm import tqdm

from attnlab.errors import AttnlabError
from attnlab.io import raise_for_target
from attnlab.text.chinese_words import JiebaSegmenter, chinese_word_starts
from attnlab.text.sentences import read_sentences
from attnlab.text.tokenizer import BertTokenizer

# Bumped whenever the cache layout or the tokenization rules change, so old caches miss.
_CACHE_FORMAT = 4  # 4: sentences cut at attnlab.text.sentences._MAX_SENTENCE_CHARS
# Sentences tokenized at a time, and most characters: a chunk's encodings, which take far
# more memory than the ids they hold, stay bounded whatever the size of a document.
_CHUNK_SENTENCES = 10_000
_CHUNK_CHARS = 1 << 20
_HELD_OUT_SEED = 20190524  # fixed: the held-out documents never depend on a run's --seed
_VERIFY_CHUNK = 1 << 24  # array elements read at a time when a reused cache is checked

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
        is read once from disk.
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
        segmenter = JiebaSegmenter() if chinese_words else None
        _prepare_cache_root(cache_root, keep=target)
        _tokenize_into_place(paths, file_keys, tokenizer, segmenter, target, damaged, progress)
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


# ---- building a cache ------------------------------------------------------------------------


def _scratch_path(cache_root: Path, name: str) -> Path:
    """A dot-name in cache_root for this process's work on the cache `name`.

    It names this process, so that `_remove_dead_builds` can tell the scratch folders left
    by a process that died from those of a build still running.
    """
    return cache_root / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def _prepare_cache_root(cache_root: Path, keep: Path) -> None:
    """Create cache_root, and remove what a dead build left and the caches none can use again."""
    if cache_root.exists() and not cache_root.is_dir():  # mkdir would say "File exists"
        raise AttnlabError(f"cache directory {cache_root} is a file, not a directory")
    cache_root.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(cache_root)
    # Before tokenizing, so that an edited corpus's old cache makes room for its new one:
    # what is removed can never be served again, so a build that fails loses nothing.
    _remove_stale_caches(cache_root, keep=keep)


def _tokenize_into_place(
    paths: list[Path],
    file_keys: list[list[str | int]],
    tokenizer: BertTokenizer,
    segmenter: JiebaSegmenter | None,
    target: Path,
    replace: bool,
    progress: bool,
) -> None:
    """Write the cache in a scratch folder and rename it to target (replacing a damaged one)."""
    # Built under a temporary name and renamed, so a crash or a concurrent build never
    # leaves a half-written cache where `open` would find it.
    scratch = _scratch_path(target.parent, target.name)
    try:
        scratch.mkdir()  # in the try: a read-only cache refuses it, naming the scratch
        _write_corpus(paths, file_keys, tokenizer, segmenter, scratch, progress)
        if replace and target.is_dir():
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


# ---- garbage collection: the caches and scratch folders no build can use again ---------------


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
        doomed = _scratch_path(cache_root, cache.name)
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


# ---- cache names: what a cache was built from ------------------------------------------------


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


# ---- tokenizing into the array files ---------------------------------------------------------


def _encode_chunk(tokenizer: BertTokenizer, sentences: list[str]) -> list[tokenizers.Encoding]:
    """WordPiece encodings of sentences, without specials or truncation."""
    # The untruncated backend: a pretraining sentence longer than the model's max_length
    # is cut later, by the example builder, not dropped here.
    return tokenizer.backend.encode_batch(sentences, add_special_tokens=False)


def _write_corpus(
    paths: list[Path],
    file_keys: list[list[str | int]],
    tokenizer: BertTokenizer,
    segmenter: JiebaSegmenter | None,
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

    def __init__(
        self, out: Path, tokenizer: BertTokenizer, segmenter: JiebaSegmenter | None
    ) -> None:
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
        """Tokenize and append a chunk of sentences; `ends_document` marks each document's last."""
        token_arrays, start_arrays = [], []
        sentence_ends, document_ends = [], []
        encodings = _encode_chunk(self.tokenizer, sentences)
        for text, encoding, last in zip(sentences, encodings, ends_document, strict=True):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            # A sentence of only control characters tokenizes to nothing: drop it.
            if len(ids):
                starts = ~self.continuation[ids]
                if self.segmenter is not None:
                    starts = chinese_word_starts(self.segmenter, text, encoding.offsets, starts)
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
