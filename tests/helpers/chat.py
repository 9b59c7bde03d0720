"""A chat tokenizer for tests: the byte tokenizer as a Hugging Face tokenizer folder with a ChatML
template, so that each character is one token and loss masks can be written by hand."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


def chat_tokenizer_dir(folder: Path) -> Path:
    """Write the byte tokenizer with the ChatML template to ``folder``."""
    from tierwise.train.tokenizers import ByteTokenizer
    from transformers import AutoTokenizer

    ByteTokenizer().save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return folder


def chatml(messages) -> tuple[str, list[bool]]:
    """The ChatML text of ``messages`` and, per character, whether it belongs to an assistant's
    turn (its content and the end-of-turn marker after it), built by hand."""
    text, trained = "", []
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        body = f"{m['content']}<|im_end|>\n"
        text += head + body
        trained += [False] * len(head) + [m["role"] == "assistant"] * len(body)
    return text, trained


def hand_labels(messages) -> tuple[list[int], list[int]]:
    """The ids of a conversation and its labels: -100 outside the assistant turns."""
    text, trained = chatml(messages)
    ids = list(text.encode())
    return ids, [t if keep else -100 for t, keep in zip(ids, trained, strict=True)]
