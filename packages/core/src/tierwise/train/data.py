"""Training data: documents in, fixed-length token blocks out, in a resumable order.

Documents come from text files, globs, ``.jsonl`` files (their ``text`` field), a directory
saved by ``datasets.save_to_disk`` or, when no ``--data`` is given, the Python standard library's
own ``.py`` sources (present on every machine with Python). Documents are tokenised, joined with
an end-of-document token, and the last ``eval_fraction`` of the tokens is held out for the eval
loss. The rest is cut into blocks of ``seq`` tokens (packing: documents run across blocks).

The batch order is a pure function of (seed, micro-step): the data position saved in a checkpoint
is just the number of micro-batches consumed.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from tierwise.train.errors import TrainError

DATASETS_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
"""Files ``datasets.save_to_disk`` writes; a directory holding one is loaded with load_from_disk."""

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
"""Files taken from a plain directory given as ``--data``."""

DATA_HELP = (
    "give text files, globs (quoted), .jsonl files with a 'text' field or a datasets "
    "save_to_disk directory, or leave --data out to train on the Python standard library's source"
)


@dataclass(frozen=True, kw_only=True)
class Document:
    """One unit of text (a file or a jsonl record)."""

    name: str
    """Where it came from (path, path:line, dataset row)."""
    text: str
    """Its text."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus end-of-document (256) and padding (257). No download."""

    name = "bytes"
    vocab_size = 258
    eos_id = 256
    pad_id = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(
            np.int64
        )

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, folder: str | Path) -> None:
        """This tokenizer as a Hugging Face tokenizer folder (``AutoTokenizer.from_pretrained``
        gives the same ids: byte b is token b, ``<|endoftext|>`` 256, ``<|pad|>`` 257).

        [Note: the byte tokenizer as a Hugging Face tokenizer]
        A byte-level BPE with no merges: the pre-tokenizer maps each byte to one printable
        character (GPT-2's byte-to-character table), the vocabulary maps that character back to
        the byte's value, and the decoder turns characters into bytes again. The special tokens
        are never matched inside text (``split_special_tokens``), as here, where text is only
        ever bytes.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {char: byte for byte, char in enumerate(_byte_characters())}
        vocab.update({BYTE_EOS: self.eos_id, BYTE_PAD: self.pad_id})
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token=BYTE_EOS,
            pad_token=BYTE_PAD,
            split_special_tokens=True,
        ).save_pretrained(folder)


BYTE_EOS = "<|endoftext|>"
BYTE_PAD = "<|pad|>"


def _byte_characters() -> list[str]:
    """The character standing for each byte value in a byte-level BPE vocabulary: printable
    Latin-1 characters stand for themselves, the others (controls, space, soft hyphen) for
    code points from 256 up, in byte order."""
    stands_for_itself = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, spare = [], 256
    for byte in range(256):
        if byte in stands_for_itself:
            chars.append(chr(byte))
        else:
            chars.append(chr(spare))
            spare += 1
    return chars


class HFTokenizer:
    """A local Hugging Face tokenizer directory (``--tokenizer DIR``), never downloaded."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TrainError(
                f"--tokenizer {path} needs transformers: pip install 'tierwise[hf]'"
            ) from None
        if not Path(path).is_dir():
            raise TrainError(
                f"--tokenizer {path}: no such directory; give a local Hugging Face tokenizer "
                "directory, or leave --tokenizer out to use bytes"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise TrainError(
                f"--tokenizer {path}: cannot load a tokenizer from it ({err})"
            ) from None
        self.name = path
        self.vocab_size = len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | None) -> Tokenizer:
    """``--tokenizer DIR`` or, without it, the byte-level tokenizer."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


# -- documents ------------------------------------------------------------------------------
def stdlib_documents() -> list[Document]:
    """The standard library's top-level ``.py`` files, sorted by name (the default corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        Document(name=str(path), text=path.read_text(encoding="utf-8", errors="replace"))
        for path in sorted(root.glob("*.py"))
    ]


def read_documents(sources: Sequence[str]) -> list[Document]:
    """Documents from every ``--data`` source, in the order given (files sorted within a source).

    Raises TrainError naming the source when it is missing, empty or unreadable.
    """
    if not sources:
        return stdlib_documents()
    documents: list[Document] = []
    for source in sources:
        found = _read_source(source)
        if not found:
            raise TrainError(f"--data {source}: no text found in it; {DATA_HELP}")
        documents.extend(found)
    return documents


def _read_source(source: str) -> list[Document]:
    if glob.has_magic(source):
        paths = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not paths:
            raise TrainError(f"--data {source}: no files match this pattern; {DATA_HELP}")
        return [doc for path in paths for doc in _read_file(path)]
    path = Path(source)
    if path.is_dir():
        if any((path / marker).is_file() for marker in DATASETS_MARKERS):
            return _read_datasets_dir(path)
        paths = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not p.name.startswith(".")
        )
        return [doc for p in paths for doc in _read_file(p)]
    if path.is_file():
        return _read_file(path)
    raise TrainError(f"--data {source}: no such file or directory; {DATA_HELP}")


def _read_file(path: Path) -> list[Document]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        return [Document(name=str(path), text=text)] if text else []
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TrainError(f"--data {path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise TrainError(f"--data {path}:{number}: each jsonl line needs a string field 'text'")
        documents.append(Document(name=f"{path}:{number}", text=record["text"]))
    return documents


def _read_datasets_dir(path: Path) -> list[Document]:
    try:
        import datasets
    except ImportError:
        raise TrainError(
            f"--data {path} is a datasets directory, but the datasets package is not installed: "
            "pip install datasets"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else sorted(loaded)[0]
        loaded = loaded[split]
    if "text" not in loaded.column_names:
        raise TrainError(
            f"--data {path}: the dataset has columns {loaded.column_names}, it needs a 'text' column"
        )
    return [Document(name=f"{path}[{i}]", text=text) for i, text in enumerate(loaded["text"])]


# -- tokens and blocks ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Corpus:
    """Tokenised data cut into blocks."""

    train_blocks: torch.Tensor
    """(n_train, seq) int64 token ids for training."""
    eval_blocks: torch.Tensor
    """(n_eval, seq) int64 held-out token ids for the eval loss."""
    n_documents: int
    """How many documents went in."""
    n_tokens: int
    """How many tokens they made (with end-of-document tokens)."""


def build_corpus(
    documents: Sequence[Document],
    tokenizer: Tokenizer,
    *,
    seq: int,
    min_train_blocks: int,
    eval_fraction: float = 0.05,
    max_eval_blocks: int = 64,
) -> Corpus:
    """Tokenise, hold out the last ``eval_fraction`` of tokens, cut both parts into blocks.

    The eval blocks are at most ``max_eval_blocks``, spread evenly over the held-out tokens.
    """
    pieces = []
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    for doc in documents:
        pieces += [tokenizer.encode(doc.text), eos]
    tokens = (
        torch.from_numpy(np.concatenate(pieces)) if pieces else torch.empty(0, dtype=torch.int64)
    )
    n_eval_tokens = max(seq, int(len(tokens) * eval_fraction))
    train_tokens, eval_tokens = tokens[:-n_eval_tokens], tokens[-n_eval_tokens:]
    n_train = len(train_tokens) // seq
    if n_train < min_train_blocks or len(eval_tokens) < seq:
        raise TrainError(
            f"the data has {len(tokens):,} tokens: too few for {min_train_blocks} training blocks "
            f"of --seq {seq} plus a held-out block; give more --data, or lower --seq or --batch"
        )
    train_blocks = train_tokens[: n_train * seq].view(n_train, seq)
    all_eval = eval_tokens[: (len(eval_tokens) // seq) * seq].view(-1, seq)
    pick = torch.linspace(0, len(all_eval) - 1, min(max_eval_blocks, len(all_eval))).round().long()
    return Corpus(
        train_blocks=train_blocks,
        eval_blocks=all_eval[pick.unique()],
        n_documents=len(documents),
        n_tokens=len(tokens),
    )


class BlockSampler:
    """Which training blocks micro-step ``m`` of rank ``rank`` reads.

    Every epoch visits the blocks in a fresh random order drawn from ``seed`` and the epoch
    number; each micro-step takes ``batch × world`` consecutive blocks of that order, rank r the
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


def batch_of(blocks: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """A causal-LM batch: labels are the inputs (the model shifts them)."""
    ids = blocks.to(device)
    return {"input_ids": ids, "labels": ids}
