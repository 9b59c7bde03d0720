"""The pieces of `tierwise train` against plain references: data, schedule, presets, metrics,
options, the memory trace and the plot."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import tierwise
import torch
import transformers
from tierwise import model_presets
from tierwise.model_presets import ModelError
from tierwise.train import blocks, data, presets, schedule, token_cache
from tierwise.train.errors import TrainError
from tierwise.train.metrics import MetricsLog, read_metrics, step_record
from tierwise.train.options import TrainOptions
from tierwise.train.plot import plot_memory, plot_training
from tierwise.train.trace import StepTracer, transformer_blocks


# -- data ---------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trips_utf8():
    tokenizer = data.ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tokenizer.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode([*ids.tolist(), tokenizer.eos_id, tokenizer.pad_id]) == text


def test_default_corpus_is_the_standard_library_in_name_order():
    import sysconfig
    from pathlib import Path

    docs = list(data.read_documents(()))
    expected = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    assert [d.name for d in docs] == [str(p) for p in expected]
    assert docs[0].text == expected[0].read_text(encoding="utf-8", errors="replace")


def test_sources_files_globs_jsonl_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    (tmp_path / "notes.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.md").write_text("gamma")
    (sub / "image.png").write_bytes(b"\x89PNG")

    texts = lambda sources: [d.text for d in data.read_documents(sources)]  # noqa: E731
    assert texts([str(tmp_path / "b.txt"), str(tmp_path / "a.txt")]) == ["beta", "alpha"]
    assert texts([str(tmp_path / "*.txt")]) == ["alpha", "beta"]
    assert texts([str(tmp_path / "notes.jsonl")]) == ["one", "two"]
    assert texts([str(sub)]) == ["gamma"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"text": "ok"}\n{"body": "no text"}\n',
            "notes.jsonl:2: each jsonl line needs a string field 'text'",
        ),
        ("{broken\n", "notes.jsonl:1: not valid JSON"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    (tmp_path / "notes.jsonl").write_text(content)
    with pytest.raises(TrainError, match=message):
        list(data.read_documents([str(tmp_path / "notes.jsonl")]))


def test_missing_sources_say_what_to_give(tmp_path):
    with pytest.raises(TrainError, match="no such file or directory; give text files"):
        list(data.read_documents([str(tmp_path / "nope.txt")]))
    with pytest.raises(TrainError, match="no files match this pattern"):
        list(data.read_documents([str(tmp_path / "*.nothing")]))


def test_datasets_directory_without_datasets_installed(tmp_path, monkeypatch):
    (tmp_path / "dataset_dict.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(TrainError, match="pip install datasets"):
        list(data.read_documents([str(tmp_path)]))


def _corpus(tmp_path, docs, *, seq, min_train_blocks, eval_fraction=0.05):
    cache = token_cache.build(tmp_path / "cache", docs, data.ByteTokenizer(), train_on_prompt=False)
    return blocks.Corpus(
        cache,
        seq=seq,
        pack=True,
        pad_id=data.ByteTokenizer.pad_id,
        min_train_blocks=min_train_blocks,
        eval_fraction=eval_fraction,
    )


def test_corpus_blocks_are_the_token_stream_and_eval_is_held_out(tmp_path):
    tokenizer = data.ByteTokenizer()
    docs = [data.Document(name=str(i), text=f"document {i} " * 20) for i in range(40)]
    corpus = _corpus(tmp_path, docs, seq=16, min_train_blocks=4, eval_fraction=0.1)
    stream = []
    for doc in docs:
        stream += [*tokenizer.encode(doc.text).tolist(), tokenizer.eos_id]
    n_eval = int(len(stream) * 0.1)
    train = corpus.train_batch(np.arange(corpus.n_train))["input_ids"].flatten().tolist()
    assert train == stream[: len(train)]
    assert len(train) == (len(stream) - n_eval) // 16 * 16
    held_out = stream[-n_eval:]
    for block in corpus.eval_batch(0, corpus.n_eval)["input_ids"].tolist():
        starts = [i for i in range(0, len(held_out) - 15, 16) if held_out[i : i + 16] == block]
        assert starts, "every eval block comes from the held-out tail"
    assert corpus.n_tokens == len(stream)


def test_corpus_too_small_says_what_to_change(tmp_path):
    docs = [data.Document(name="x", text="tiny")]
    with pytest.raises(TrainError, match="lower --seq or --batch"):
        _corpus(tmp_path, docs, seq=64, min_train_blocks=1)


def test_sampler_covers_each_epoch_once_and_splits_ranks():
    n_blocks, batch, world = 50, 4, 2
    samplers = [
        blocks.BlockSampler(n_blocks=n_blocks, batch=batch, world=world, rank=r, seed=3)
        for r in range(world)
    ]
    per_epoch = n_blocks // (batch * world)
    seen = [i for step in range(per_epoch) for s in samplers for i in s.indices(step).tolist()]
    assert len(seen) == len(set(seen)) == per_epoch * batch * world
    # a fresh sampler (a resumed run) reads exactly the same micro-batches, epochs included
    fresh = blocks.BlockSampler(n_blocks=n_blocks, batch=batch, world=world, rank=1, seed=3)
    for step in (per_epoch + 2, 0, 2 * per_epoch + 1):
        assert torch.equal(fresh.indices(step), samplers[1].indices(step))
    assert not torch.equal(samplers[0].indices(per_epoch), samplers[0].indices(0))


# -- schedule -----------------------------------------------------------------------------------
def test_warmup_then_cosine_to_the_floor():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=2.0)
    scheduler = schedule.warmup_cosine(optimizer, warmup=3, total=11, floor=0.1)
    lrs = []
    for _ in range(13):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    for step in range(3, 11):
        progress = (step - 3) / 7
        assert lrs[step] == pytest.approx(
            2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )
    assert lrs[10] == lrs[11] == lrs[12] == pytest.approx(0.2)


# -- presets ------------------------------------------------------------------------------------
def _random_init(config, seed: int) -> torch.nn.Module:
    """What `tierwise train` does for random init: build on meta, seed, set up."""
    model = presets.build_random(config)
    assert all(p.is_meta for p in model.parameters())  # no memory for the parameters
    presets.seed_init(seed)
    model, _ = tierwise.setup(
        model, torch.optim.AdamW(model.parameters()), precision="fp32", device="cpu"
    )
    return model


def _plain_model(config, seed: int) -> torch.nn.Module:
    """A random-init model in plain PyTorch (fp32 on the CPU), outside tierwise."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("family", model_presets.FAMILIES)
def test_presets_build_a_causal_lm_with_the_tokenizer_vocabulary(family):
    tokenizer = data.ByteTokenizer()
    config = model_presets.preset_config(
        family, "tiny", vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, max_positions=64
    )
    model = _random_init(config, seed=0)
    ids = torch.randint(0, 256, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, tokenizer.vocab_size)
    assert math.isfinite(out.loss.item())
    again, other = _random_init(config, seed=0), _random_init(config, seed=1)
    first, second, third = (m.state_dict() for m in (model, again, other))
    assert first.keys() == second.keys() == third.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # deterministic in the seed
    assert any(not torch.equal(first[k], third[k]) for k in first)  # and the seed matters


def test_unknown_preset_and_size():
    with pytest.raises(ModelError, match="choose one of gpt2, opt, llama, mixtral"):
        model_presets.preset_config("gpt5", "tiny", vocab_size=258, eos_id=256, max_positions=64)
    with pytest.raises(ModelError, match="unknown --size 'huge'"):
        model_presets.preset_config("gpt2", "huge", vocab_size=258, eos_id=256, max_positions=64)


@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_from_pretrained_loads_the_saved_weights(tmp_path, family):
    config = model_presets.preset_config(
        family, "tiny", vocab_size=258, eos_id=256, max_positions=64
    )
    model = _plain_model(config, seed=1)
    model.save_pretrained(tmp_path)
    on_meta = presets.pretrained_on_meta(str(tmp_path))
    assert on_meta.training and all(p.is_meta for p in on_meta.parameters())
    loaded, _ = tierwise.setup(
        on_meta,
        torch.optim.AdamW(on_meta.parameters()),
        weights=str(tmp_path),
        precision="fp32",
        device="cpu",
    )
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert all(torch.equal(saved[k], back[k]) for k in saved)


def test_model_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vocab_size": 300,
            }
        )
    )
    config = model_presets.config_from_file(str(path))
    assert (config.model_type, config.hidden_size, config.vocab_size) == ("llama", 32, 300)
    presets.check_vocab(config, data.ByteTokenizer(), "--model-config")
    path.write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(ModelError, match="needs a 'model_type'"):
        model_presets.config_from_file(str(path))
    config.vocab_size = 100
    with pytest.raises(TrainError, match="vocab_size 100 is smaller than the tokenizer's 258"):
        presets.check_vocab(config, data.ByteTokenizer(), "--model-config")


# -- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"steps": 0}, "--steps 0: must be at least 1"),
        ({"stop_after": 9, "steps": 5}, "--stop-after 9: must be between 1 and --steps"),
        ({"warmup": 5, "steps": 5}, "--warmup 5: must be between 0 and --steps - 1"),
        ({"lr": -1.0}, "--lr -1.0: must be positive"),
        ({"model_config": "a.json", "from_pretrained": "dir"}, "not both"),
    ],
)
def test_options_say_what_to_change(given, message):
    with pytest.raises(TrainError, match=message):
        TrainOptions(**given)


# -- metrics ------------------------------------------------------------------------------------
def test_step_record_counts_what_moved_in_the_step():
    before = {"moved_bytes": {"host->device": 100}, "moves": {"host->device": 1}}
    now = {
        "bytes_by_tier": {"device": 10, "host": 20},
        "peak_bytes_by_tier": {"device": 12},
        "moved_bytes": {"host->device": 350, "device->host": 40},
        "moves": {"host->device": 3, "device->host": 1},
        "comm_bytes": {},
    }
    record = step_record(
        step=4,
        loss=1.5,
        lr=0.1,
        grad_norm=None,
        tokens=1000,
        times={"data": 0.1, "forward": 0.2, "backward": 0.3, "optimizer": 0.4, "total": 2.0},
        stats=now,
        stats_before=before,
    )
    assert record["moved_bytes"] == {"host->device": 250, "device->host": 40}
    assert record["moved_bytes_total"] == {"host->device": 350, "device->host": 40}
    assert record["moves"] == {"host->device": 2, "device->host": 1}
    assert record["tokens_per_s"] == 500.0


def test_metrics_log_drops_steps_after_the_resumed_checkpoint(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3, 4):
        log.write({"kind": "train", "step": step, "loss": float(step)})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # torn by a crash
    log = MetricsLog(tmp_path, keep_through=2)
    log.write({"kind": "train", "step": 3, "loss": 30.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
    ]


# -- trace and plot -----------------------------------------------------------------------------
class _FakeStats:
    """Stands in for engine.stats(): nothing is managed by an engine in these tests."""

    def __call__(self):
        return {
            "bytes_by_tier": {"device": 1 << 20, "host": 3 << 20},
            "moved_bytes": {"host->device": 0},
        }


def _traced_step(model):
    tracer = StepTracer(model, _FakeStats(), step=1, budgets={"device": 2 << 20, "host": None})
    tracer.mark("forward", "step starts")
    ids = torch.randint(0, 256, (2, 16))
    with tracer.forward():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    tracer.backward_finished()
    tracer.mark("optimizer", "optimizer step done")
    return tracer.trace


def test_trace_follows_the_blocks_and_frees_activations_in_backward():
    config = model_presets.preset_config(
        "gpt2", "tiny", vocab_size=258, eos_id=256, max_positions=64
    )
    model = _plain_model(config, seed=0)
    n_blocks = len(transformer_blocks(model))
    assert n_blocks == config.n_layer
    trace = _traced_step(model)
    labels = [s.label for s in trace.samples]
    assert labels == (
        ["step starts"]
        + [f"block {i} forward" for i in range(n_blocks)]
        + [
            x
            for i in reversed(range(n_blocks))
            for x in (f"block {i} backward starts", f"block {i} backward done")
        ]
        + ["backward done", "optimizer step done"]
    )
    alive = [s.activation_bytes for s in trace.samples]
    forward = alive[1 : n_blocks + 1]
    assert all(b > a for a, b in zip([0] + forward, forward, strict=False)), (
        "each block saves activations"
    )
    done = [s.activation_bytes for s in trace.samples if s.label.endswith("backward done")]
    assert all(b < a for a, b in zip(done, done[1:], strict=False)) and done[-1] == 0


def test_plot_writes_a_png_or_says_why_not(tmp_path, monkeypatch):
    config = model_presets.preset_config(
        "gpt2", "tiny", vocab_size=258, eos_id=256, max_positions=64
    )
    trace = _traced_step(_plain_model(config, seed=0))
    lines = [{"step": s, "moved_bytes": {"host->device": s * 1000}} for s in range(1, 5)]
    path = tmp_path / "memory.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert plot_memory(path, trace, lines, title="test") is None
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        path.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    note = plot_memory(path, trace, lines, title="test")
    assert note == "memory.png skipped: matplotlib is not installed (pip install 'tierwise[plot]')"
    assert not path.exists()


def test_training_plot_writes_a_png_or_says_why_not(tmp_path, monkeypatch):
    lines = [
        {"kind": "train", "step": s, "loss": 5.0 / s, "tokens_per_s": 1000.0 + s}
        for s in range(1, 9)
    ] + [{"kind": "eval", "step": s, "eval_loss": 6.0 / s} for s in (4, 8)]
    path = tmp_path / "training.png"
    try:
        import matplotlib.image
    except ImportError:
        pass
    else:
        assert plot_training(path, lines, title="test") is None
        height, width, _ = matplotlib.image.imread(path).shape
        assert width > height > 0
        path.unlink()
        assert plot_training(path, lines[-2:], title="test") == (
            "training.png skipped: no training step was logged"
        )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    note = plot_training(path, lines, title="test")
    assert (
        note == "training.png skipped: matplotlib is not installed (pip install 'tierwise[plot]')"
    )
    assert not path.exists()
