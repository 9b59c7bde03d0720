"""Training data: documents in, one at a time, each tokenised into ids and a loss mask.

Documents come from text files, globs, ``.jsonl`` files, a directory saved by
``datasets.save_to_disk`` or, when no ``--data`` is given, the Python standard library's own
``.py`` sources (present on every machine with Python). A jsonl line (or dataset row) is one of
three kinds:

- ``{"text": ...}``: plain text, every token trained;
- ``{"prompt": ..., "completion": ...}``: loss on the completion only (``--train-on-prompt``:
  on both); strings are joined as they are, lists of chat messages go through the chat template;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the tokenizer's chat
  template, loss on the assistant turns only (``--train-on-prompt``: on every token).

Documents are read lazily (a jsonl file line by line, a dataset row by row), so nothing here
holds more than one document: ``token_cache`` writes their tokens to disk as they come.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierwise.train.errors import TrainError
from tierwise.train.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

DATASETS_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
"""Files ``datasets.save_to_disk`` writes; a directory holding one is loaded with load_from_disk."""

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
"""Files taken from a plain directory given as ``--data``."""

DATA_HELP = (
    "give text files, globs (quoted), .jsonl files (fields 'text', 'messages' or 'prompt' and "
    "'completion') or a datasets save_to_disk directory, or leave --data out to train on the "
    "Python standard library's source"
)

KINDS = ("text", "prompt_completion", "messages")
"""The kinds of document a jsonl line or dataset row can be."""


@dataclass(frozen=True, kw_only=True)
class Document:
    """One unit of training data (a file, a jsonl line or a dataset row)."""

    name: str
    """Where it came from (path, path:line, dataset row)."""
    text: str | None = None
    """Plain text (kind "text")."""
    prompt: str | list | None = None
    """The prompt of a prompt/completion pair: a string, or chat messages."""
    completion: str | list | None = None
    """The completion of a prompt/completion pair (a string, or chat messages)."""
    messages: list | None = None
    """A conversation: a list of {"role", "content"} dicts (kind "messages")."""

    @property
    def kind(self) -> str:
        if self.messages is not None:
            return "messages"
        if self.prompt is not None:
            return "prompt_completion"
        return "text"


@dataclass(frozen=True, kw_only=True)
class Tokenised:
    """One document's tokens and which of them the loss is taken on."""

    ids: np.ndarray
    """Token ids (int64)."""
    trained: np.ndarray | None
    """Per token, whether it is a training target (bool); None: every token is."""


# -- documents ------------------------------------------------------------------------------
def source_files(sources: Sequence[str]) -> list[Path]:
    """Every file ``--data`` names, in reading order (the standard library's ``.py`` files when
    none is given): what the token cache's key is made of. Raises TrainError naming a source
    that does not exist or matches nothing."""
    if not sources:
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    files: list[Path] = []
    for source in sources:
        files.extend(_files_of(source))
    return files


def _files_of(source: str) -> list[Path]:
    if glob.has_magic(source):
        paths = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not paths:
            raise TrainError(f"--data {source}: no files match this pattern; {DATA_HELP}")
        return paths
    path = Path(source)
    if path.is_dir():
        if _is_datasets_dir(path):
            return sorted(p for p in path.rglob("*") if p.is_file())
        return sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not p.name.startswith(".")
        )
    if path.is_file():
        return [path]
    raise TrainError(f"--data {source}: no such file or directory; {DATA_HELP}")


def _is_datasets_dir(path: Path) -> bool:
    return any((path / marker).is_file() for marker in DATASETS_MARKERS)


def read_documents(sources: Sequence[str]) -> Iterator[Document]:
    """Documents from every ``--data`` source, in the order given (files sorted within a
    source), one at a time. Raises TrainError naming the source when it is missing, empty or
    unreadable (as iteration reaches it)."""
    if not sources:
        for path in source_files(()):
            yield Document(name=str(path), text=path.read_text(encoding="utf-8", errors="replace"))
        return
    for source in sources:
        found = False
        path = Path(source)
        if path.is_dir() and _is_datasets_dir(path):
            documents: Iterator[Document] = _read_datasets_dir(path)
        else:
            documents = (doc for file in _files_of(source) for doc in _read_file(file))
        for doc in documents:
            found = True
            yield doc
        if not found:
            raise TrainError(f"--data {source}: no text found in it; {DATA_HELP}")


def _read_file(path: Path) -> Iterator[Document]:
    if path.suffix != ".jsonl":
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield Document(name=str(path), text=text)
        return
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TrainError(f"--data {path}:{number}: not valid JSON ({err.msg})") from None
            yield document_of(record, f"{path}:{number}")


def document_of(record: Any, name: str) -> Document:
    """A jsonl line's or dataset row's document; TrainError naming it when it has none of the
    fields of the three kinds."""
    if isinstance(record, dict):
        if isinstance(record.get("messages"), list):
            return Document(name=name, messages=record["messages"])
        prompt, completion = record.get("prompt"), record.get("completion")
        if prompt is not None or completion is not None:
            same_kind = isinstance(prompt, str) and isinstance(completion, str)
            same_kind |= isinstance(prompt, list) and isinstance(completion, list)
            if not same_kind:
                raise TrainError(
                    f"--data {name}: 'prompt' and 'completion' must both be strings or both "
                    "lists of chat messages"
                )
            return Document(name=name, prompt=prompt, completion=completion)
        if isinstance(record.get("text"), str):
            return Document(name=name, text=record["text"])
    raise TrainError(
        f"--data {name}: each jsonl line needs a string field 'text', a list 'messages', or "
        "'prompt' and 'completion'"
    )


def _read_datasets_dir(path: Path) -> Iterator[Document]:
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
    columns = set(loaded.column_names)
    if not ({"text", "messages"} & columns or {"prompt", "completion"} <= columns):
        raise TrainError(
            f"--data {path}: the dataset has columns {loaded.column_names}, it needs a 'text' "
            "or 'messages' column, or 'prompt' and 'completion'"
        )
    for i, row in enumerate(loaded):  # arrow-backed: one row in memory at a time
        yield document_of(row, f"{path}[{i}]")


# -- tokens and loss masks ------------------------------------------------------------------
def tokenise(doc: Document, tokenizer: Tokenizer, *, train_on_prompt: bool) -> Tokenised:
    """``doc``'s tokens and loss mask.

    Text ends with the end-of-document token. A prompt/completion pair is tokenised as the
    prompt, then prompt and completion together (as TRL does), the completion followed by the
    end-of-document token: the tokens past the prompt's are the completion's. A conversation is
    the chat template's text; an assistant turn is the text that rendering the turn adds after
    the conversation before it rendered with the generation prompt.
    """
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    if doc.kind == "text":
        return Tokenised(ids=np.concatenate([tokenizer.encode(doc.text), eos]), trained=None)
    chat = doc.kind == "messages" or isinstance(doc.prompt, list)
    if chat:
        _need_chat_template(tokenizer, doc)
    if doc.kind == "prompt_completion" and not chat:
        prompt_ids = tokenizer.encode(doc.prompt)
        ids = np.concatenate([tokenizer.encode(doc.prompt + doc.completion), eos])
        trained = np.arange(len(ids)) >= len(prompt_ids)
        return Tokenised(ids=ids, trained=None if train_on_prompt else trained)
    messages = doc.messages if doc.kind == "messages" else [*doc.prompt, *doc.completion]
    assistant = (
        range(len(doc.prompt), len(messages))
        if doc.kind == "prompt_completion"
        else [i for i, m in enumerate(messages) if _role(m, doc) == "assistant"]
    )
    text = tokenizer.render_chat(messages)
    if train_on_prompt:
        return Tokenised(ids=tokenizer.encode(text), trained=None)
    spans = _assistant_spans(tokenizer, messages, assistant, text, doc)
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained |= (offsets[:, 0] >= start) & (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return Tokenised(ids=ids, trained=trained)


def _need_chat_template(tokenizer: Tokenizer, doc: Document) -> None:
    if isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template:
        return
    if isinstance(tokenizer, ByteTokenizer):
        raise TrainError(
            f"--data {doc.name} holds chat messages, which need a chat template; the byte "
            "tokenizer has none: give --tokenizer DIR (or --from-pretrained DIR) with one"
        )
    raise TrainError(
        f"--data {doc.name} holds chat messages, but the tokenizer {tokenizer.name} has no chat "
        "template: use a tokenizer with one, or prompt/completion strings"
    )


def _role(message: Any, doc: Document) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TrainError(f"--data {doc.name}: each message needs a string 'role' and a 'content'")
    return message["role"]


def _assistant_spans(
    tokenizer: HFTokenizer, messages: list, assistant: Sequence[int], text: str, doc: Document
) -> list[tuple[int, int]]:
    """The character spans of the assistant turns in ``text`` (the whole conversation)."""
    spans = []
    for i in assistant:
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True) if i else ""
        through = tokenizer.render_chat(messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise TrainError(
                f"--data {doc.name}: the chat template of {tokenizer.name} renders earlier turns "
                "differently once later ones follow, so the assistant tokens cannot be told "
                "apart: give --train-on-prompt, or prompt/completion strings"
            )
        spans.append((len(before), len(through)))
    return spans


__all__ = [
    "DATA_HELP",
    "KINDS",
    "Document",
    "Tokenised",
    "document_of",
    "load_tokenizer",
    "read_documents",
    "source_files",
    "tokenise",
]
