"""clip_grad_norm_ under fp16 loss scaling: each parameter's norm is taken in fp32, so a scaled
norm above fp16's largest value (65504) stays finite and the clip coefficient is the one an
fp32 loop computes (a float16 norm was inf: the coefficient became 0 and the step applied zero
gradients while the gradients themselves were finite)."""

import tierwise
import torch
from helpers.models import tiny_batch, tiny_model


def test_fp16_scaled_norms_above_the_float16_range_stay_finite():
    reference = tiny_model("gpt2")
    reference(**tiny_batch(seed=0)).loss.backward()
    norms = [p.grad.norm() for p in reference.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack(norms))

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp16",
        device="cpu",
        param_placement="device",
        optimizer_placement="device",
    )
    scale = tierwise.engine_of(model).loss_scale
    assert max(norms) * scale > torch.finfo(torch.float16).max  # the case this test is about
    model(**tiny_batch(seed=0)).loss.backward()
    total = tierwise.clip_grad_norm_(model, 1.0)
    assert torch.isfinite(total)
    assert abs(float(total) - float(expected)) <= 1e-2 * float(expected)
