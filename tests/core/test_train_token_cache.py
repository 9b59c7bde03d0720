"""`tierwise train`'s token cache ([Note: the token cache]): built once, reused, keyed by the data
and the tokenizer, compact, shared by ranks, and read with memory that does not grow with the
corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers.multiproc import run_ranks
from tierwise.train import data, token_cache
from tierwise.train.distributed import World
from tierwise.train.errors import TrainError
from tierwise.train.options import TrainOptions
from tierwise.train.prepare import _token_cache
from tierwise.train.tokenizers import ByteTokenizer


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _open(path: Path, root: Path, tokenizer=None, *, train_on_prompt=False, documents=None):
    tokenizer = tokenizer or ByteTokenizer()
    return token_cache.open_or_build(
        [str(path)],
        tokenizer,
        train_on_prompt=train_on_prompt,
        root=root,
        documents=data.read_documents([str(path)]) if documents is None else documents,
    )


def _never():
    raise AssertionError("a reused cache reads no document")
    yield  # pragma: no cover


def test_built_once_then_reused_and_keyed_by_data_and_tokenizer(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    root = tmp_path / "cache"
    cache, reused = _open(path, root)
    assert not reused
    again, reused = _open(path, root, documents=_never())
    assert reused and again.path == cache.path
    assert np.array_equal(np.asarray(again.tokens), np.asarray(cache.tokens))
    # the ids are the byte tokenizer's, each document ended by its end-of-document token
    expected = [t for i in range(10) for t in [*f"doc {i}".encode(), ByteTokenizer.eos_id]]
    assert np.asarray(cache.tokens).tolist() == expected
    assert cache.tokens.dtype == np.uint16 and cache.trained is None
    # another prompt rule, or changed data, is another cache
    assert _open(path, root, train_on_prompt=True)[0].path != cache.path
    _jsonl(path, [{"text": f"doc {i}!"} for i in range(10)])
    changed, reused = _open(path, root)
    assert not reused and changed.path != cache.path


class _WideTokenizer(ByteTokenizer):
    """Bytes, in a vocabulary too large for 16-bit ids."""

    vocab_size = 70_000
    eos_id = 69_999

    def identity(self) -> str:
        return "wide"


def test_ids_take_two_bytes_when_the_vocabulary_fits_else_four(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "abc"}])
    narrow, _ = _open(path, tmp_path / "c")
    wide, _ = _open(path, tmp_path / "c", _WideTokenizer())
    assert narrow.tokens.dtype == np.uint16 and wide.tokens.dtype == np.uint32
    assert np.asarray(wide.tokens).tolist() == [*b"abc", 69_999]
    assert os.path.getsize(narrow.path / token_cache.TOKENS_FILE) == 4 * 2


def test_the_loss_mask_is_stored_only_when_some_token_is_not_trained(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"text": "ab"}, {"prompt": "Q", "completion": "A"}, {"text": "c"}]
    )
    cache, _ = _open(path, tmp_path / "c")
    eos = ByteTokenizer.eos_id
    assert np.asarray(cache.tokens).tolist() == [*b"ab", eos, *b"QA", eos, *b"c", eos]
    assert np.asarray(cache.trained).tolist() == [1, 1, 1, 0, 1, 1, 1, 1]
    assert np.asarray(cache.doc_starts).tolist() == [0, 3, 6, 8]


# -- ranks share it -------------------------------------------------------------------------------
def _rank_opens(rank: int, world: int, data_path: str, root: str):
    options = TrainOptions(data=(data_path,), token_cache=root)
    try:
        cache, note = _token_cache(
            options, ByteTokenizer(), World(rank=rank, size=world, device="cpu")
        )
    except TrainError as err:
        return ("error", str(err))
    return ("ok", str(cache.path), note)


def test_rank_zero_builds_and_the_others_reuse_its_cache(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(20)])
    results = run_ranks(_rank_opens, 2, str(path), str(tmp_path / "c"), timeout=180)
    assert results[0][0] == results[1][0] == "ok" and results[0][1] == results[1][1]
    assert "tokenised into" in results[0][2] and "(reused)" in results[1][2]


def test_a_failure_on_rank_zero_reaches_every_rank_without_a_hang(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "no text"}])
    results = run_ranks(
        _rank_opens, 2, str(path), str(tmp_path / "c"), timeout=180, collective_timeout=60
    )
    assert results[0][0] == results[1][0] == "error"
    assert results[0][1] == results[1][1] and "d.jsonl:2" in results[1][1]


# -- memory ---------------------------------------------------------------------------------------
PEAK_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    from tierwise.train import blocks, data, token_cache
    from tierwise.train.tokenizers import ByteTokenizer

    source, root = sys.argv[1], Path(sys.argv[2])
    tokenizer = ByteTokenizer()
    cache, _ = token_cache.open_or_build(
        [source], tokenizer, train_on_prompt=False, root=root,
        documents=data.read_documents([source]),
    )
    corpus = blocks.Corpus(cache, seq=256, pack=True, pad_id=tokenizer.pad_id, min_train_blocks=8)
    sampler = blocks.BlockSampler(n_blocks=corpus.n_train, batch=8, world=1, rank=0, seed=0)
    for step in range(200):
        corpus.train_batch(sampler.indices(step))
    for start in range(0, corpus.n_eval, 8):
        corpus.eval_batch(start, start + 8)
    status = Path("/proc/self/status").read_text()
    peak = next(line for line in status.splitlines() if line.startswith("VmHWM"))
    print(cache.n_tokens, int(peak.split()[1]) * 1024)
    """
)

RSS_TOLERANCE = 8 << 20
"""Allowed growth of the peak RSS from the small corpus to the 20× one. What does grow with the
corpus is the row index: each row's start and length (16 bytes a row of 256 tokens, copied once
when rows without a target are dropped) and the sampler's order (8 bytes a row), about 3 MiB for
the ~18M tokens here (measured: 4.3 MiB, allocator slack included); the token and mask files
themselves are read with pread and never mapped ([Note: the token cache]). Mapped instead, the
200 random batches of a run grew RSS by 55 MiB on the large corpus."""


def _peak(tmp_path: Path, name: str, n_records: int) -> tuple[int, int]:
    """Build and read a corpus of ``n_records`` prompt/completion pairs (~1 KiB each) in a
    fresh process; its token count and VmHWM."""
    path = tmp_path / f"{name}.jsonl"
    with open(path, "w") as out:
        for i in range(n_records):
            prompt = f"question {i}: " + "why " * (i % 50 + 20)
            out.write(json.dumps({"prompt": prompt, "completion": " because " * 80}) + "\n")
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    tokens, peak = result.stdout.split()[-2:]
    return int(tokens), int(peak)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    small_tokens, small_peak = _peak(tmp_path, "small", 1_000)
    large_tokens, large_peak = _peak(tmp_path, "large", 20_000)
    assert large_tokens >= 19 * small_tokens  # 20× the data (prompt lengths cycle)
    assert large_peak - small_peak <= RSS_TOLERANCE, (small_peak, large_peak)
