"""`tierwise train`'s instruction data: chat messages through the tokenizer's chat template and
prompt/completion pairs, their loss masks, packing with documents kept apart, checked against
masks and losses built by hand with plain transformers, and against TRL's SFTTrainer on the same
conversations (tests/trl/test_instruction_loss.py, in the frameworks env)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from helpers.chat import CONVERSATION, chat_tokenizer_dir, chatml  # noqa: E402
from helpers.models import _config  # noqa: E402
from tierwise.train import blocks, data, token_cache  # noqa: E402
from tierwise.train.errors import TrainError  # noqa: E402
from tierwise.train.prepare import packs_apart  # noqa: E402
from tierwise.train.tokenizers import ByteTokenizer, HFTokenizer  # noqa: E402


def _chat_tokenizer(tmp_path) -> HFTokenizer:
    return HFTokenizer(str(chat_tokenizer_dir(tmp_path / "chat-tokenizer")))


def test_messages_mask_the_assistant_turns(tmp_path):
    tokenizer = _chat_tokenizer(tmp_path)
    doc = data.Document(name="x", messages=CONVERSATION)
    got = data.tokenise(doc, tokenizer, train_on_prompt=False)
    text, trained = chatml(CONVERSATION)
    assert got.ids.tolist() == list(text.encode())
    assert got.trained.tolist() == trained
    everything = data.tokenise(doc, tokenizer, train_on_prompt=True)
    assert everything.ids.tolist() == list(text.encode()) and everything.trained is None


def test_prompt_completion_masks_the_prompt(tmp_path):
    tokenizer = ByteTokenizer()
    doc = data.Document(name="x", prompt="2+2=", completion="4")
    got = data.tokenise(doc, tokenizer, train_on_prompt=False)
    assert got.ids.tolist() == [*b"2+2=4", tokenizer.eos_id]
    assert got.trained.tolist() == [False] * 4 + [True, True]
    assert data.tokenise(doc, tokenizer, train_on_prompt=True).trained is None
    chat = data.Document(
        name="y", prompt=CONVERSATION[:2], completion=[{"role": "assistant", "content": "Paris."}]
    )
    got = data.tokenise(chat, _chat_tokenizer(tmp_path), train_on_prompt=False)
    text, trained = chatml(CONVERSATION[:3])
    assert got.ids.tolist() == list(text.encode()) and got.trained.tolist() == trained


def test_chat_data_with_the_byte_tokenizer_is_refused_in_one_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    doc = next(data.read_documents([str(path)]))
    with pytest.raises(TrainError, match="byte tokenizer has none") as err:
        data.tokenise(doc, ByteTokenizer(), train_on_prompt=False)
    assert "\n" not in str(err.value) and "chat.jsonl:1" in str(err.value)


def test_jsonl_kinds_and_a_line_of_none(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"text": "a"}, {"prompt": "p", "completion": "c"}, {"messages": CONVERSATION}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    kinds = [doc.kind for doc in data.read_documents([str(path)])]
    assert kinds == ["text", "prompt_completion", "messages"]
    path.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(TrainError, match=r"mixed.jsonl:1: each jsonl line needs"):
        list(data.read_documents([str(path)]))


def _cache(tmp_path, records, tokenizer, *, train_on_prompt=False) -> token_cache.TokenCache:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cache, _ = token_cache.open_or_build(
        [str(path)],
        tokenizer,
        train_on_prompt=train_on_prompt,
        root=tmp_path / "cache",
        documents=data.read_documents([str(path)]),
    )
    return cache


PAIRS = [
    {"prompt": "Q: " + "ab" * (i % 5) + "?\nA:", "completion": " " + "xyz"[i % 3] * (3 + i % 4)}
    for i in range(40)
]


def _hand_rows(tokenizer, records, seq):
    """Every document's (ids, labels) built by hand: the prompt's bytes -100, the completion's
    and the end-of-document token kept (the first token of a document is never a target)."""
    out = []
    for r in records:
        ids = [*(r["prompt"] + r["completion"]).encode(), tokenizer.eos_id]
        labels = [-100] * len(r["prompt"].encode()) + ids[len(r["prompt"].encode()) :]
        labels[0] = -100
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_rows_match_hand_built_labels_and_positions(tmp_path, pack):
    tokenizer, seq = ByteTokenizer(), 16 if pack else 32  # packed: documents cross rows
    cache = _cache(tmp_path, PAIRS, tokenizer)
    corpus = blocks.Corpus(
        cache, seq=seq, pack=pack, pad_id=tokenizer.pad_id, min_train_blocks=4, eval_fraction=0.1
    )
    docs = _hand_rows(tokenizer, PAIRS, seq)
    stream_ids = [t for ids, _ in docs for t in ids]
    stream_labels = [t for _, labels in docs for t in labels]
    doc_start_of = []  # per stream token: where its document starts
    for ids, _ in docs:
        doc_start_of += [len(doc_start_of)] * len(ids)
    if pack:  # row r is tokens r*seq.. of the stream; positions restart at each document
        batch = corpus.train_batch(np.arange(corpus.n_train))
        for r in range(corpus.n_train):
            span = slice(r * seq, (r + 1) * seq)
            # a document carried over from the row before counts from 0 again at the row start
            pos = [t - max(r * seq, doc_start_of[t]) for t in range(r * seq, (r + 1) * seq)]
            labels = [
                lab if p > 0 else -100 for lab, p in zip(stream_labels[span], pos, strict=True)
            ]
            assert batch["input_ids"][r].tolist() == stream_ids[span]
            assert batch["position_ids"][r].tolist() == pos
            assert batch["labels"][r].tolist() == labels
    else:  # one document per row (each fits in seq here), padded with -100 labels
        batch = corpus.train_batch(np.arange(corpus.n_train))
        assert "position_ids" not in batch
        for r in range(corpus.n_train):
            ids, labels = docs[r]
            pad = seq - len(ids)
            assert batch["input_ids"][r].tolist() == ids + [tokenizer.pad_id] * pad
            assert batch["labels"][r].tolist() == labels + [-100] * pad


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama", "mixtral"])
def test_packed_documents_attend_only_to_themselves(kind):
    """Where packing is used, the packed row's logits are those of each document run alone; OPT
    builds its attention mask without the position ids, so it gets one document per row, and
    packed there its documents would see each other."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(kind, vocab_size=258)).eval()
    assert packs_apart(model) == (kind != "opt")
    docs = [torch.randint(0, 256, (n,)) for n in (5, 9, 2)]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    if packs_apart(model):
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.allclose(together, alone, rtol=1e-3, atol=1e-3)


def _reference_loss(model, rows) -> torch.Tensor:
    """Plain transformers, each document alone, labels masked by hand: the mean cross-entropy
    over every target token of the batch (what TRL's SFT loss is)."""
    total, count = torch.zeros(()), 0
    for ids, labels in rows:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        target = torch.tensor(labels[1:])
        keep = target != -100
        total = total + torch.nn.functional.cross_entropy(
            logits[keep], target[keep], reduction="sum"
        )
        count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("pack", [True, False])
def test_batch_loss_equals_the_hand_masked_reference(tmp_path, pack):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config("llama", vocab_size=258)).eval()
    tokenizer, seq = ByteTokenizer(), 32
    cache = _cache(tmp_path, PAIRS, tokenizer)
    corpus = blocks.Corpus(
        cache, seq=seq, pack=pack, pad_id=tokenizer.pad_id, min_train_blocks=4, eval_fraction=0.1
    )
    docs = _hand_rows(tokenizer, PAIRS, seq)
    rows = list(range(4))
    if pack:  # each row's pieces of documents, split by hand where documents start
        stream_ids = [t for ids, _ in docs for t in ids]
        stream_labels = [t for _, labels in docs for t in labels]
        doc_starts = set(np.cumsum([0] + [len(ids) for ids, _ in docs]).tolist())
        picked = []
        for r in rows:
            cuts = [t for t in range(r * seq, (r + 1) * seq) if t in doc_starts or t == r * seq]
            for a, b in zip(cuts, [*cuts[1:], (r + 1) * seq], strict=True):
                picked.append((stream_ids[a:b], [-100, *stream_labels[a + 1 : b]]))
    else:
        picked = docs[:4]
    with torch.no_grad():
        loss = model(**corpus.train_batch(np.asarray(rows))).loss
        reference = _reference_loss(model, picked)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)


def test_chat_loss_equals_the_hand_masked_reference(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config("llama", vocab_size=258)).eval()
    tokenizer = _chat_tokenizer(tmp_path)
    records = [{"messages": CONVERSATION[: 3 + 2 * (i % 2)]} for i in range(30)]
    cache = _cache(tmp_path, records, tokenizer)
    corpus = blocks.Corpus(cache, seq=256, pack=False, pad_id=tokenizer.pad_id, min_train_blocks=4)
    rows = []
    for r in records[:4]:
        text, trained = chatml(r["messages"])
        ids = list(text.encode())
        rows.append((ids, [t if keep else -100 for t, keep in zip(ids, trained, strict=True)]))
    with torch.no_grad():
        loss = model(**corpus.train_batch(np.arange(4))).loss
        reference = _reference_loss(model, rows)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
