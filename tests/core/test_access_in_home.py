"""Per-step work the runtime skips on the smallest plans (issue 39): with every chunk computing
in its home, module access fetches nothing after the warm-up ([Note: accesses when every chunk
computes in its home]), and the "keep" blocks' saved activations are counted as a plain PyTorch
reference counts them ([Note: kept tensors counted in one pass])."""

from __future__ import annotations

import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import overhead_config
from tierwise.runtime.activations.policy import find_blocks


def _step(model, opt) -> None:
    model(**tiny_batch()).loss.backward()
    opt.step()
    opt.zero_grad()


def _fetches_after_warmup(placement: str) -> int:
    model, opt = overhead_config(placement)
    engine = tierwise.engine_of(model)
    _step(model, opt)  # warm-up: the access trace is recorded
    fetched = []
    fetch = engine.residency.fetch
    engine.residency.fetch = lambda chunk: (fetched.append(chunk.key), fetch(chunk))[1]
    _step(model, opt)
    return len(fetched)


def test_module_access_fetches_nothing_when_every_chunk_computes_in_its_home():
    assert _fetches_after_warmup("device") == 0
    assert _fetches_after_warmup("host") > 0  # the rCache's chunks are still fetched


def _reference_kept_bytes() -> int:
    """Bytes the blocks of the plain model save for backward: per block, each distinct storage
    of at least 1024 bytes that is no parameter's, as ``ActivationManager`` counts them."""
    model = tiny_model("gpt2")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counted: list[dict[int, int]] = []
    for block in find_blocks(model).values():
        seen: dict[int, int] = {}
        counted.append(seen)

        def pack(tensor, seen=seen):  # the graph holds it: no address is reused in forward
            storage = tensor.untyped_storage()
            if storage.nbytes() >= 1024 and storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        block.register_forward_pre_hook(lambda *_, h=hooks: h.__enter__())
        block.register_forward_hook(lambda *_, h=hooks: h.__exit__(None, None, None))
    model(**tiny_batch()).loss.backward()
    return sum(sum(seen.values()) for seen in counted)


def test_kept_activations_are_counted_as_the_plain_model_saves_them_every_step():
    want = _reference_kept_bytes()
    model, opt = overhead_config("device")
    engine = tierwise.engine_of(model)
    for _ in range(3):  # the warm-up and two steps after it
        _step(model, opt)
        stats = engine.stats()["activations"]
        assert set(stats["policy"]) == {"keep"}
        assert stats["saved_peak_bytes"] == want > 0
