"""Tokenizers of `tierwise train`: UTF-8 bytes (no download) or a local Hugging Face tokenizer
directory (which may carry a chat template)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from tierwise.train.errors import TrainError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def identity(self) -> str:
        """What the token ids depend on (the token cache's key includes it)."""
        ...


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

    def identity(self) -> str:
        return "bytes-v1"

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
        self.path = Path(path)
        self.name = path
        self.vocab_size = len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``text`` and each token's (start, end) character offsets."""
        out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(out["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        return np.asarray(out["input_ids"], dtype=np.int64), offsets

    def render_chat(self, messages: list, *, add_generation_prompt: bool = False) -> str:
        """``messages`` as text, through the tokenizer's chat template."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def identity(self) -> str:
        """The tokenizer's class, its files' contents and its chat template."""
        digest = hashlib.sha256(type(self.tokenizer).__name__.encode())
        for file in sorted(self.path.iterdir()):
            if file.is_file() and (
                file.name.startswith(
                    (
                        "tokenizer",
                        "special_tokens",
                        "vocab",
                        "merges",
                        "chat_template",
                        "added_tokens",
                    )
                )
                or file.suffix == ".model"
            ):
                digest.update(file.name.encode())
                digest.update(file.read_bytes())
        digest.update(str(getattr(self.tokenizer, "chat_template", "")).encode())
        return digest.hexdigest()


def load_tokenizer(path: str | None) -> Tokenizer:
    """``--tokenizer DIR`` or, without it, the byte-level tokenizer."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


__all__ = ["BYTE_EOS", "BYTE_PAD", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]
