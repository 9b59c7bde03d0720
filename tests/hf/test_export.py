"""`tierwise train --lora` and `tierwise export`: from_pretrained folders from a run's checkpoint."""

import json

import pytest
import safetensors.torch
import tierwise
import torch
import transformers
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from hf_helpers import logits_of
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.cli import main
from tierwise.train.export import PEFT_PREFIX, export
from tierwise.train.lora import describe_model

RUN = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--batch",
    "2",
    "--seq",
    "32",
    "--sample-tokens",
    "0",
    "--steps",
    "3",
    "--precision",
    "fp32",
    "--device",
    "cpu",
    "--eval-batches",
    "1",
]
IDS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("def f(x):\n    return x * 2\n" * 400)
    return path


def cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def latest(run):
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def weights(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(file))
    return out


def resumed_model(run):
    """The run's model as tierwise resumes it (its own checkpoint loading, not the exporter)."""
    config = transformers.AutoConfig.from_pretrained(run / "hf")
    model = transformers.AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu", chunk_size=4096)
    tierwise.load_checkpoint(latest(run), model)
    return model


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", *RUN, "--data", corpus, "--out", run)
    assert code == 0, err
    assert f"tierwise export {run} {run / 'hf-model'}" in out  # the end says how to export
    code, _, err = cli(capsys, "export", run, tmp_path / "fp32")
    assert code == 0, err
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["dtype"] == "float32"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp32", attn_implementation="eager"
    )
    trained = resumed_model(run)
    trained.config._attn_implementation = "eager"
    ids = tiny_batch(seed=7)["input_ids"]  # the tiny model's vocabulary
    assert torch.equal(logits_of(loaded, ids), logits_of(trained, ids))

    # shards of at most 20 kB: several files and an index, loading to the same model
    export(run, tmp_path / "sharded", max_shard_bytes=20_000)
    files = sorted((tmp_path / "sharded").glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    biggest = max(v.numel() * 4 for v in weights(tmp_path / "fp32").values())
    assert all(f.stat().st_size <= max(20_000, biggest) + 4096 for f in files)  # + header
    resharded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "sharded", attn_implementation="eager"
    )
    assert torch.equal(logits_of(resharded, IDS), logits_of(loaded, IDS))

    code, _, err = cli(capsys, "export", run, tmp_path / "bf16", "--dtype", "bf16")
    assert code == 0, err
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    halves, singles = weights(tmp_path / "bf16"), weights(tmp_path / "fp32")
    assert halves.keys() == singles.keys()
    assert all(
        v.dtype == torch.bfloat16 and torch.equal(v, singles[k].bfloat16())
        for k, v in halves.items()
    )


def test_export_of_a_run_without_checkpoint_is_one_line(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    describe_model(run, tiny_model("llama"))
    code, _, err = cli(capsys, "export", run, tmp_path / "out")
    assert code == 2
    assert err.count("\n") == 1 and "no checkpoint" in err and "--save-every" in err
    assert not (tmp_path / "out").exists()


def _save_on_ranks(rank, world, run):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu", chunk_size=2048)
    for step in range(2):
        model(**tiny_batch(seed=10 * step + rank)).loss.backward()
        opt.step()
        opt.zero_grad()
    tierwise.save_checkpoint(run / "checkpoints" / "step-000002", model)
    return model.state_dict()  # collective


def test_export_reads_a_checkpoint_saved_by_two_ranks(tmp_path, capsys):
    run = tmp_path / "run"
    state = run_ranks(_save_on_ranks, 2, run)[0]
    describe_model(run, tiny_model("llama"))
    (run / "checkpoints" / "latest").write_text("step-000002")
    code, _, err = cli(capsys, "export", run, tmp_path / "out")
    assert code == 0, err
    written = weights(tmp_path / "out")
    assert written.keys() == state.keys() and "lm_head.weight" in written
    assert all(torch.equal(v, state[k]) for k, v in written.items())
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing (filled randomly), unexpected, ...
    trained = tiny_model("llama")
    trained.load_state_dict(state)
    ids = tiny_batch(seed=7)["input_ids"]  # the tiny model's vocabulary
    assert torch.equal(logits_of(loaded, ids), logits_of(trained, ids))


def test_lora_run_exports_adapters_and_a_merged_model_equal_to_merge_and_unload(
    tmp_path, corpus, capsys
):
    peft = pytest.importorskip("peft", reason="--lora needs peft (tierwise[peft])")
    run = tmp_path / "run"
    code, out, err = cli(
        capsys,
        "train",
        *RUN,
        "--data",
        corpus,
        "--out",
        run,
        "--lora",
        "4",
        "--lora-alpha",
        "16",
        "--lora-targets",
        "q_proj,v_proj",
    )
    assert code == 0, err
    assert "--merge-lora" in out
    reader = CheckpointReader(latest(run))
    assert {reader.trainable(n) for n in reader.names()} == {True, False}
    assert all(reader.trainable(n) == (".lora_" in n) for n in reader.names())

    assert cli(capsys, "export", run, tmp_path / "adapter")[0] == 0
    assert cli(capsys, "export", run, tmp_path / "merged", "--merge-lora")[0] == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    # the base the adapters were trained on, from the checkpoint (it stayed frozen)
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(run / "hf")
    )
    base_state = {
        n.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): reader.tensor(n)
        for n in reader.names()
        if ".lora_" not in n
    }
    base.load_state_dict(base_state)
    with_adapters = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    lora_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert torch.equal(with_adapters.state_dict()[lora_a], reader.tensor(lora_a))
    reference = with_adapters.merge_and_unload().state_dict()
    merged = weights(tmp_path / "merged")
    assert all(torch.equal(v, reference[k]) for k, v in merged.items())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        merged[q], reader.tensor(f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.base_layer.weight")
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert loaded.config.architectures == ["LlamaForCausalLM"]

    # the run had a random base (no --from-pretrained): the adapter export carries it in base/
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(
        (tmp_path / "adapter" / "base").resolve()
    )
    written_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base")
    assert written_base.state_dict().keys() == base_state.keys()
    assert all(torch.equal(written_base.state_dict()[k], v) for k, v in base_state.items())
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")  # finds base/
    assert torch.equal(auto.state_dict()[lora_a], reader.tensor(lora_a))
    assert torch.allclose(logits_of(auto, IDS), logits_of(loaded, IDS), atol=1e-5)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"lora": 0}, "--lora 0: the adapter rank must be at least 1"),
        ({"lora_alpha": 8.0}, "need --lora R"),
        ({"lora": 4, "lora_alpha": -1.0}, "--lora-alpha -1.0: must be positive"),
    ],
)
def test_lora_options_say_what_to_change(given, message):
    from tierwise.train.errors import TrainError
    from tierwise.train.options import TrainOptions

    with pytest.raises(TrainError, match=message):
        TrainOptions(**given)


def _bpe_tokenizer(folder, texts):
    """A BPE tokenizer trained on ``texts``, saved as a Hugging Face folder."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def _without_size(flags: list[str]) -> list[str]:
    """``flags`` less ``--size X`` (a checkpoint gives the model's shape; train refuses both)."""
    at = flags.index("--size")
    return [*flags[:at], *flags[at + 2 :]]


@pytest.mark.parametrize("flag", ["--tokenizer", "--from-pretrained"])
def test_export_copies_the_run_tokenizer(tmp_path, corpus, capsys, flag):
    texts = corpus.read_text().splitlines() + ["return the value of f", "x times two"]
    original = _bpe_tokenizer(tmp_path / "given", texts)
    if flag == "--from-pretrained":  # a model folder that has a tokenizer
        tiny_model("llama").save_pretrained(tmp_path / "given")
    run = tmp_path / "run"
    run_flags = RUN if flag == "--tokenizer" else _without_size(RUN)  # the checkpoint's shape
    code, _, err = cli(
        capsys, "train", *run_flags, "--data", corpus, "--out", run, flag, tmp_path / "given"
    )
    assert code == 0, err
    for flags in ([], ["--dtype", "bf16"]):
        out = tmp_path / f"out{len(flags)}"
        assert cli(capsys, "export", run, out, *flags)[0] == 0
        exported = transformers.AutoTokenizer.from_pretrained(out)
        assert exported.get_vocab() == original.get_vocab()
        assert exported.eos_token == "</s>"
        for text in ["def f(x):\n    return x * 2", "two values, unseen words: zebra"]:
            assert exported(text)["input_ids"] == original(text)["input_ids"]
            assert exported.decode(exported(text)["input_ids"]) == original.decode(
                original(text)["input_ids"]
            )
