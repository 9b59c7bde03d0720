"""What a newcomer does with an export (issue 30): load the tokenizer and generate, find the base
of a LoRA adapter, read the files as another user, merge LoRA as PEFT does on the same base."""

from __future__ import annotations

import json
import os
import stat

import pytest
import safetensors.torch
import torch
import transformers
from helpers.models import tiny_model
from tierwise.cli import main
from tierwise.train.data import ByteTokenizer
from tierwise.train.export import PEFT_PREFIX

RUN = [
    *("--model", "llama", "--size", "tiny", "--batch", "2", "--seq", "32"),
    *("--sample-tokens", "0", "--steps", "2", "--device", "cpu", "--eval-batches", "1"),
]
RUN_FROM_PRETRAINED = [f for f in RUN if f not in ("--size", "tiny")]
"""RUN for a checkpoint, which gives the model's shape (train refuses --size beside it)."""
TEXTS = ["def f(x):\n    return x * 2", "héllo wörld ✓\t\x00", "<|endoftext|> is text here", ""]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("def f(x):\n    return x * 2\n" * 400)
    return path


def cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def weights(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(file))
    return out


def test_default_run_export_ships_the_byte_tokenizer_and_generates(tmp_path, corpus, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    cli(capsys, "train", *RUN, "--data", corpus, "--out", run)
    old = os.umask(0o027)  # a stricter umask than the usual 022: the files follow it
    try:
        cli(capsys, "export", run, out)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {0o640}, modes

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = ByteTokenizer()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text).tolist()  # byte b is token b, no BOS added
        assert tokenizer.decode(ids) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (ours.eos_id, ours.pad_id)

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    inputs = tokenizer(["def "], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    ids = inputs["input_ids"]
    with torch.no_grad():  # greedy decoding by hand: one forward per token
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)
    assert isinstance(tokenizer.decode(generated[0]), str)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_lora_export_names_its_base_and_merges_as_peft_on_the_same_base(
    tmp_path, corpus, capsys, monkeypatch, precision
):
    """The frozen base is held in the run's precision: bf16 by default (the merge then starts
    from the bf16-rounded base, as the run trained on it), fp32 with --precision fp32 (the
    merge then equals PEFT's on the checkpoint's own fp32 weights)."""
    peft = pytest.importorskip("peft", reason="--lora needs peft (tierwise[peft])")
    base_dir = tmp_path / "hf" / "base"
    original = tiny_model("llama", vocab_size=ByteTokenizer.vocab_size)
    original.save_pretrained(base_dir)
    monkeypatch.chdir(tmp_path)  # the base given as a relative path, as in the issue
    run = tmp_path / "run"
    cli(
        capsys,
        *("train", *RUN_FROM_PRETRAINED, "--data", corpus, "--out", run),
        *("--precision", precision, "--from-pretrained", "./hf/base", "--lora", "4"),
        *("--lora-targets", "q_proj,v_proj"),
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # export and loading run from another directory
    cli(capsys, "export", run, tmp_path / "adapter")
    cli(capsys, "export", run, tmp_path / "merged", "--merge-lora")

    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir.resolve())
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")  # finds the base
    assert auto is not None

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    if precision == "bf16":  # the base the run held
        with torch.no_grad():
            for p in base.parameters():
                p.copy_(p.bfloat16().float())
    reference = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    expected = reference.state_dict()
    merged = weights(tmp_path / "merged")
    assert merged.keys() <= expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in merged.items())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], original.state_dict()[q].bfloat16().float())  # trained
    exact = {k: v for k, v in original.state_dict().items() if k in merged}
    differs = [k for k in exact if not torch.equal(merged[k], exact[k])]
    if precision == "fp32":  # untouched weights are the checkpoint's own fp32 values
        assert set(differs) == {k for k in exact if "q_proj" in k or "v_proj" in k}
    else:  # ... or their bf16 rounding
        assert "model.embed_tokens.weight" in differs
    assert all(not n.startswith(PEFT_PREFIX) for n in merged)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_lora_state_dict_holds_the_base_in_the_run_precision(precision):
    """``state_dict()`` of a LoRA model returns the frozen base as the run holds it: its bf16
    rounding by default, the original fp32 values with precision="fp32"."""
    import tierwise

    peft = pytest.importorskip("peft", reason="LoRA needs peft (tierwise[peft])")
    original = tiny_model("llama")
    expected = {k: v.clone() for k, v in original.state_dict().items()}
    model = peft.get_peft_model(
        original, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    model, _ = tierwise.setup(
        model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad),
        precision=precision, device="cpu",
    )  # fmt: skip
    got = {
        n.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): v
        for n, v in model.state_dict().items()
        if ".lora_" not in n
    }
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        held = value if precision == "fp32" else value.bfloat16().float()
        assert torch.equal(got[name].float(), held), name
