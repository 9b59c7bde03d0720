"""`tierwise export` of a run saved under expert or tensor parallelism: one process writes a
folder that from_pretrained loads, and it computes what the single-process model with the same
weights computes (and what the parallel model computed)."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
import tierwise  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from tierwise.train.export import export  # noqa: E402
from tierwise.train.lora import describe_model  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _train_and_save(rank, world, kind, parallel, run):
    model = w.build_model(kind)
    opt = w.make_optimizer(model)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        parallel=parallel,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    )
    tensor = parallel.get("tensor", 1)
    batch = w.batch_slice(w.global_batch(), rank // tensor, world // tensor)
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    tierwise.save_checkpoint(run / "checkpoints" / "step-000002", model, opt)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    return {"ids": batch["input_ids"], "logits": logits, "state": model.state_dict()}


@pytest.mark.parametrize(
    ("kind", "parallel"),
    [("mixtral", {"expert": 2}), ("llama", {"tensor": 2})],
    ids=["ep2", "tp2"],
)
def test_export_of_a_model_parallel_run_gives_the_single_process_logits(tmp_path, kind, parallel):
    run = tmp_path / "run"
    ranks = run_ranks(_train_and_save, 2, kind, parallel, run)
    describe_model(run, w.build_model(kind))
    (run / "checkpoints" / "latest").write_text("step-000002")
    export(run, tmp_path / "out", max_shard_bytes=50_000)  # several shards

    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    single = w.build_model(kind)  # the same weights, gathered by the parallel model itself
    single.load_state_dict(ranks[0]["state"], strict=True)
    single.config._attn_implementation = "eager"
    single.eval()
    assert all(torch.equal(loaded.state_dict()[n], v) for n, v in single.state_dict().items())
    for result in ranks:
        with torch.no_grad():
            exported = loaded(input_ids=result["ids"]).logits
            reference = single(input_ids=result["ids"]).logits
        assert torch.equal(exported, reference)
        assert w.max_relative_error(result["logits"], exported) <= 1e-5
