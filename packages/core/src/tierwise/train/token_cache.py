"""The token cache: the data tokenised once, on disk, memory-mapped.

[Note: the token cache]
Tokenising a large corpus takes long and its ids, held as int64 tensors, take 8 bytes a token
(twice, while they are concatenated). So documents are tokenised once, as they are read, and
appended to flat files in one directory: ``tokens.bin`` (uint16 ids when the vocabulary fits,
else uint32), ``doc_starts.bin`` (int64: where each document starts, then the end) and, when
some tokens are not training targets (a prompt, a user turn), ``trained.bin`` (uint8 per token).
``meta.json`` says what is there. Building holds only the documents of one write batch. The files
are plain arrays ``numpy.memmap`` opens (``TokenCache.tokens``); the training loop reads its rows
with ``os.pread`` instead (``TokenCache.read``), because a mapped page counts in the process's
RSS once touched, and an epoch of random rows would map the whole corpus: read, a row's bytes sit
in the kernel's page cache, which the kernel reclaims under pressure, never in the process. So
RSS does not grow with the corpus (beyond the 8 bytes a document of ``doc_starts``, mapped, and
the row index the sampler draws from).

The directory's name is a hash of what the ids depend on: each data file's path, size and
modification time (not its contents: hashing a corpus would read it all on every run), the
tokenizer's identity, whether the prompt is trained on, and this format's version. A resumed run
and a new run on the same data find it again; a changed file or tokenizer gives a new key. A
build writes a temporary directory and renames it into place, so a cache is whole or absent, and
two processes building the same one at once waste work but never mix files.

Under torchrun rank 0 builds while the other ranks wait on a broadcast of its outcome (bounded
by the collective timeout); a failure on rank 0 reaches every rank as the same error. A rank that
then finds no cache (another machine, no shared disk) builds its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierwise.probe import cache_dir
from tierwise.train.data import Document, Tokenised, source_files, tokenise
from tierwise.train.tokenizers import Tokenizer

FORMAT_VERSION = 1
"""Bumped when the files' layout or the tokenisation rules change."""

META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
STARTS_FILE = "doc_starts.bin"
TRAINED_FILE = "trained.bin"

WRITE_BATCH_TOKENS = 1 << 18
"""Tokens gathered before they are written (bounds the build's memory)."""


def default_cache_root() -> Path:
    """``tokens/`` in tierwise's cache directory (``$TIERWISE_CACHE_DIR``, else
    ``~/.cache/tierwise``)."""
    return cache_dir() / "tokens"


def cache_key(sources: Sequence[str], tokenizer: Tokenizer, *, train_on_prompt: bool) -> str:
    """The hash naming the cache of this data and tokenizer ([Note: the token cache])."""
    digest = hashlib.sha256(f"tierwise-tokens-v{FORMAT_VERSION}\n".encode())
    digest.update(f"tokenizer {tokenizer.identity()}\ntrain_on_prompt {train_on_prompt}\n".encode())
    for path in source_files(sources):
        stat = path.stat()
        digest.update(f"{path.resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


@dataclass(frozen=True, kw_only=True)
class TokenCache:
    """A built cache, memory-mapped (read-only)."""

    path: Path
    """Its directory."""
    tokens: np.ndarray
    """Every document's ids, one after another (uint16 or uint32, memory-mapped)."""
    doc_starts: np.ndarray
    """Where each document starts in ``tokens``, then ``len(tokens)`` (int64, memory-mapped)."""
    trained: np.ndarray | None
    """Per token, 1 when it is a training target (uint8, memory-mapped); None: all are."""
    n_documents: int
    """How many documents went in."""
    masked: bool = False
    """Whether ``trained.bin`` exists (some token is not a target)."""

    def read(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens ``start:end`` (int64) and whether each is a target (bool; None: all are),
        read with ``pread`` ([Note: the token cache])."""
        ids = _pread(self.path / TOKENS_FILE, self.tokens.dtype, start, end).astype(np.int64)
        if not self.masked:
            return ids, None
        return ids, _pread(self.path / TRAINED_FILE, np.dtype(np.uint8), start, end).astype(bool)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @classmethod
    def open(cls, path: Path) -> TokenCache:
        meta = json.loads((path / META_FILE).read_text())
        n_tokens, n_docs = meta["n_tokens"], meta["n_documents"]
        tokens = _map(path / TOKENS_FILE, np.dtype(meta["dtype"]), n_tokens)
        starts = _map(path / STARTS_FILE, np.dtype(np.int64), n_docs + 1)
        trained = (
            _map(path / TRAINED_FILE, np.dtype(np.uint8), n_tokens) if meta["masked"] else None
        )
        return cls(
            path=path,
            tokens=tokens,
            doc_starts=starts,
            trained=trained,
            n_documents=n_docs,
            masked=meta["masked"],
        )


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def _pread(path: Path, dtype: np.dtype, start: int, end: int) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = os.pread(fd, (end - start) * dtype.itemsize, start * dtype.itemsize)
    finally:
        os.close(fd)
    return np.frombuffer(raw, dtype=dtype)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def build(
    path: Path,
    documents: Iterable[Document],
    tokenizer: Tokenizer,
    *,
    train_on_prompt: bool,
) -> TokenCache:
    """Tokenise ``documents`` into a cache at ``path`` (written aside, then renamed into place;
    an existing cache there is kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        meta = _write(building, documents, tokenizer, train_on_prompt=train_on_prompt)
        (building / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(building, path)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (path / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return TokenCache.open(path)


def _write(folder: Path, documents, tokenizer: Tokenizer, *, train_on_prompt: bool) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    n_tokens, n_docs, masked = 0, 0, False
    pending: list[Tokenised] = []
    pending_tokens = 0
    with (
        open(folder / TOKENS_FILE, "wb") as tokens,
        open(folder / STARTS_FILE, "wb") as starts,
        open(folder / TRAINED_FILE, "wb") as trained,
    ):

        def flush() -> None:
            nonlocal pending, pending_tokens
            if not pending:
                return
            tokens.write(np.concatenate([p.ids for p in pending]).astype(dtype).tobytes())
            if masked:
                trained.write(np.concatenate([_mask(p) for p in pending]).tobytes())
            pending, pending_tokens = [], 0

        for doc in documents:
            piece = tokenise(doc, tokenizer, train_on_prompt=train_on_prompt)
            if piece.trained is not None and not masked:  # the first masked document
                flush()
                _write_ones(trained, n_tokens)
                masked = True
            starts.write(np.int64(n_tokens).tobytes())
            pending.append(piece)
            pending_tokens += len(piece.ids)
            n_tokens += len(piece.ids)
            n_docs += 1
            if pending_tokens >= WRITE_BATCH_TOKENS:
                flush()
        flush()
        starts.write(np.int64(n_tokens).tobytes())
    if not masked:
        (folder / TRAINED_FILE).unlink()
    return {
        "format": FORMAT_VERSION,
        "n_tokens": n_tokens,
        "n_documents": n_docs,
        "dtype": dtype.name,
        "masked": masked,
        "tokenizer": tokenizer.name,
        "train_on_prompt": train_on_prompt,
    }


def _mask(piece: Tokenised) -> np.ndarray:
    if piece.trained is None:
        return np.ones(len(piece.ids), dtype=np.uint8)
    return piece.trained.astype(np.uint8)


def _write_ones(file, count: int) -> None:
    ones = np.ones(min(count, WRITE_BATCH_TOKENS), dtype=np.uint8)
    while count > 0:
        file.write(ones[: min(count, len(ones))].tobytes())
        count -= len(ones)


def open_or_build(
    sources: Sequence[str],
    tokenizer: Tokenizer,
    *,
    train_on_prompt: bool,
    root: Path,
    documents: Iterable[Document],
) -> tuple[TokenCache, bool]:
    """The cache of this data, built from ``documents`` when it is not there yet; and whether
    it was already there."""
    path = root / cache_key(sources, tokenizer, train_on_prompt=train_on_prompt)
    if (path / META_FILE).is_file():
        return TokenCache.open(path), True
    return build(path, documents, tokenizer, train_on_prompt=train_on_prompt), False


__all__ = [
    "FORMAT_VERSION",
    "TokenCache",
    "build",
    "cache_key",
    "default_cache_root",
    "open_or_build",
    "token_dtype",
]
