"""TierwiseTrainer under expert and tensor parallelism: save_model on every rank, rank 0 writes
the whole model, and from_pretrained of it computes what the parallel model computes."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

from helpers.multiproc import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _train_and_save(rank, world, out, kind, parallel):
    import torch
    import transformers
    from helpers.models import VOCAB, tiny_model
    from tierwise.integrations.hf import TierwiseTrainer

    class Blocks(torch.utils.data.Dataset):
        ids = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(5))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    args = transformers.TrainingArguments(
        output_dir=str(out / "run"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        optim="adamw_torch_fused",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = TierwiseTrainer(
        model=tiny_model(kind),
        args=args,
        train_dataset=Blocks(),
        tierwise_config={"parallel": parallel, "chunk_size": 2048},
    )
    trainer.train()
    trainer.save_model(str(out / "saved"))  # collective: rank 0 writes
    ids = Blocks.ids[:2]
    if parallel.get("tensor"):  # tensor-parallel ranks take the same batch
        torch.distributed.broadcast(ids, src=0)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits
    return {"ids": ids, "logits": logits}


@pytest.mark.parametrize(
    "kind, parallel", [("mixtral", {"expert": 2}), ("llama", {"tensor": 2})], ids=["ep2", "tp2"]
)
def test_save_model_writes_the_whole_model_from_rank_0(tmp_path, kind, parallel):
    import torch
    import transformers

    ranks = run_ranks(_train_and_save, 2, tmp_path, kind, parallel)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", attn_implementation="eager"
    ).eval()
    for result in ranks:
        with torch.no_grad():
            expected = loaded(input_ids=result["ids"]).logits
        error = (result["logits"] - expected).abs().max() / expected.abs().max()
        assert error <= 1e-5
