"""Fixed-length training rows cut from the token cache, packed or not, in a resumable order.

[Note: packed documents kept apart]
With packing (``--pack``, the default where the model can), each row is the next ``seq`` tokens
of the cache, whatever documents they belong to; each document in a row gets its own position
ids, counting from 0. Hugging Face models that build their attention mask with
``transformers.masking_utils`` read position ids that restart as document boundaries and attend
only within each document, when no attention mask and no KV cache is passed (so packed batches
say ``use_cache=False``: GPT-2 builds a cache in eval forwards otherwise). A token that starts a document (or a row) is not a target: nothing before it
in its document predicts it. A document longer than what is left of a row goes on in the next
row, counting from 0 again. Without packing (``--no-pack``, or a model that builds its mask
another way), each row holds one document, or one ``seq`` piece of a longer one, padded on the
right with labels -100 (causal attention never lets a token see the padding after it).

The last ``eval_fraction`` of the tokens is held out for the eval loss. Rows without a single
target (a piece of a long prompt) are left out: their loss would be 0/0.

The batch order is a pure function of (seed, micro-step): the data position saved in a checkpoint
is just the number of micro-batches consumed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tierwise.train.errors import TrainError
from tierwise.train.token_cache import TRAINED_FILE, TokenCache

IGNORE = -100
"""The label Hugging Face's loss skips."""

SCAN_TOKENS = 1 << 18
"""Tokens of the loss mask read at a time when counting each row's targets."""


class Corpus:
    """Training and held-out rows over a token cache."""

    def __init__(
        self,
        cache: TokenCache,
        *,
        seq: int,
        pack: bool,
        pad_id: int,
        min_train_blocks: int,
        eval_fraction: float = 0.05,
        max_eval_blocks: int = 64,
    ):
        self.cache, self.seq, self.pack, self.pad_id = cache, seq, pack, pad_id
        n_tokens = cache.n_tokens
        self.boundary = n_tokens - max(seq, int(n_tokens * eval_fraction))
        """Tokens before this train, the rest is held out."""
        train_starts, train_lengths = self._rows(0, max(self.boundary, 0))
        eval_starts, eval_lengths = self._rows(max(self.boundary, 0), n_tokens)
        keep = self._with_targets(train_starts, train_lengths)
        self.train_starts, self.train_lengths = train_starts[keep], train_lengths[keep]
        keep = self._with_targets(eval_starts, eval_lengths)
        eval_starts, eval_lengths = eval_starts[keep], eval_lengths[keep]
        if len(self.train_starts) < min_train_blocks or len(eval_starts) == 0:
            raise TrainError(
                f"the data has {n_tokens:,} tokens in {cache.n_documents:,} documents: too few "
                f"for {min_train_blocks} training blocks of --seq {seq} plus a held-out block; "
                "give more --data, or lower --seq or --batch"
            )
        pick = np.unique(
            np.round(np.linspace(0, len(eval_starts) - 1, min(max_eval_blocks, len(eval_starts))))
        ).astype(np.int64)
        self.eval_starts, self.eval_lengths = eval_starts[pick], eval_lengths[pick]

    @property
    def n_documents(self) -> int:
        return self.cache.n_documents

    @property
    def n_tokens(self) -> int:
        return self.cache.n_tokens

    @property
    def n_train(self) -> int:
        return len(self.train_starts)

    @property
    def n_eval(self) -> int:
        return len(self.eval_starts)

    def train_batch(self, indices: torch.Tensor | np.ndarray) -> dict[str, Any]:
        """The rows ``indices`` of the training rows (CPU tensors)."""
        indices = np.asarray(indices, dtype=np.int64)
        return self.batch(self.train_starts[indices], self.train_lengths[indices])

    def eval_batch(self, start: int, stop: int) -> dict[str, Any]:
        """Held-out rows ``start:stop``."""
        return self.batch(self.eval_starts[start:stop], self.eval_lengths[start:stop])

    # -- rows --------------------------------------------------------------------------------
    def _rows(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) of every row within tokens ``begin:end``."""
        seq = self.seq
        if self.pack:
            count = max(end - begin, 0) // seq
            return begin + np.arange(count, dtype=np.int64) * seq, np.full(count, seq, np.int64)
        doc_starts = np.asarray(self.cache.doc_starts)
        first = np.searchsorted(doc_starts, begin, side="right") - 1
        last = np.searchsorted(doc_starts, end, side="left")
        edges = np.clip(doc_starts[max(first, 0) : last + 1], begin, end)
        doc_begin, doc_end = edges[:-1], edges[1:]
        pieces = -(-(doc_end - doc_begin) // seq)
        starts = np.repeat(doc_begin, pieces) + seq * _counts_within(pieces)
        lengths = np.minimum(np.repeat(doc_end, pieces) - starts, seq)
        longer = lengths >= 2  # a 1-token row predicts nothing
        return starts[longer], lengths[longer]

    def _with_targets(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Which rows have a target: a trained token that is not the first of its row or of
        its document (every row of unmasked data has one)."""
        if not self.cache.masked or len(starts) == 0:
            return np.ones(len(starts), dtype=bool)
        keep = np.zeros(len(starts), dtype=bool)
        path = self.cache.path / TRAINED_FILE
        group = max(1, SCAN_TOKENS // self.seq)
        for first in range(0, len(starts), group):  # read, not mapped: RSS stays flat
            s, n = starts[first : first + group], lengths[first : first + group]
            span_begin, span_end = int(s[0]), int(s[-1] + n[-1])
            targets = np.fromfile(
                path, dtype=np.uint8, count=span_end - span_begin, offset=span_begin
            ).astype(np.int64)
            doc_starts = self.cache.doc_starts
            lo = np.searchsorted(doc_starts, span_begin, side="left")
            hi = np.searchsorted(doc_starts, span_end, side="left")
            targets[np.asarray(doc_starts[lo:hi]) - span_begin] = 0
            sums = np.concatenate([[0], np.cumsum(targets)])
            keep[first : first + group] = sums[s + n - span_begin] - sums[s + 1 - span_begin] > 0
        return keep

    def batch(self, starts: np.ndarray, lengths: np.ndarray) -> dict[str, Any]:
        """input_ids, labels (IGNORE where no target) and, packed, position_ids and
        ``use_cache=False`` ([Note: packed documents kept apart])."""
        n, seq = len(starts), self.seq
        ids = np.full((n, seq), self.pad_id, dtype=np.int64)
        labels = np.full((n, seq), IGNORE, dtype=np.int64)
        positions = np.zeros((n, seq), dtype=np.int64)
        cache = self.cache
        for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            end = start + length
            tokens, trained = cache.read(start, end)
            position = self._positions(start, end)
            if trained is None:
                trained = np.ones(length, dtype=bool)
            ids[row, :length] = tokens
            labels[row, :length] = np.where(trained & (position > 0), tokens, IGNORE)
            positions[row, :length] = position
            positions[row, length:] = np.arange(length, seq)
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.pack:
            batch["position_ids"] = torch.from_numpy(positions)
            batch["use_cache"] = False  # a KV cache hides the packing from the mask builder
        return batch

    def _positions(self, start: int, end: int) -> np.ndarray:
        """Each token's position in its document, counted from the row's start."""
        doc_starts = self.cache.doc_starts
        lo = np.searchsorted(doc_starts, start, side="right")
        hi = np.searchsorted(doc_starts, end, side="left")
        inside = np.asarray(doc_starts[lo:hi], dtype=np.int64) - start
        offsets = np.arange(end - start, dtype=np.int64)
        segment_start = np.zeros(end - start, dtype=np.int64)
        segment_start[inside] = inside
        return offsets - np.maximum.accumulate(segment_start)

    # -- the sample's prompt -----------------------------------------------------------------
    def sample_prompt(self, max_tokens: int) -> list[int]:
        """The opening of the first held-out document: its prompt (the tokens before its first
        target) for instruction data, else its first ``max_tokens // 4`` tokens (at least 1)."""
        doc_starts = self.cache.doc_starts
        doc = max(int(np.searchsorted(doc_starts, max(self.boundary, 0), side="left")), 0)
        doc = min(doc, self.cache.n_documents - 1)
        start, end = int(doc_starts[doc]), int(doc_starts[doc + 1])
        length = max(1, min(end - start, max_tokens) // 4)
        tokens, trained = self.cache.read(start, end)
        if trained is not None:
            targets = np.flatnonzero(trained)
            if len(targets) and targets[0] > 0:
                length = min(int(targets[0]), max_tokens)
        return tokens[:length].tolist()


def _counts_within(pieces: np.ndarray) -> np.ndarray:
    """0, 1, ..., p-1 for each p in ``pieces``, concatenated."""
    total = int(pieces.sum())
    firsts = np.repeat(np.cumsum(pieces) - pieces, pieces)
    return np.arange(total, dtype=np.int64) - firsts


class BlockSampler:
    """Which training rows micro-step ``m`` of rank ``rank`` reads.

    Every epoch visits the rows in a fresh random order drawn from ``seed`` and the epoch
    number; each micro-step takes ``batch × world`` consecutive rows of that order, rank r the
    r-th ``batch`` of them; a partial last micro-batch of an epoch is dropped.
    """

    def __init__(self, *, n_blocks: int, batch: int, world: int, rank: int, seed: int):
        self.n_blocks = n_blocks
        self.batch = batch
        self.world = world
        self.rank = rank
        self.seed = seed
        self.steps_per_epoch = n_blocks // (batch * world)
        if self.steps_per_epoch < 1:
            raise TrainError(
                f"{n_blocks} training blocks cannot fill one micro-batch of --batch {batch} × "
                f"{world} ranks; give more --data or lower --batch"
            )
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.int64)

    def indices(self, micro_step: int) -> torch.Tensor:
        epoch, position = divmod(micro_step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.n_blocks, generator=generator)
            self._epoch = epoch
        start = (position * self.world + self.rank) * self.batch
        return self._order[start : start + self.batch]


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on ``device`` (its flags as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


__all__ = ["IGNORE", "BlockSampler", "Corpus", "to_device"]
