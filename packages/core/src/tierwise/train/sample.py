"""A text sample from the trained model: greedy or temperature sampling, one token at a time."""

from __future__ import annotations

import unicodedata

import torch


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters other than newline and tab are shown as
    escapes (``\x1b``), so a generated escape sequence cannot move the cursor or recolour it."""
    return "".join(
        ch
        if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn")
        else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    new_tokens: int,
    temperature: float,
    context: int,
    seed: int,
    device: torch.device,
) -> list[int]:
    """``prompt_ids`` followed by ``new_tokens`` generated ids.

    Each token is one full forward over the last ``context`` ids (no KV cache: simple, and the
    engine sees ordinary forwards). ``temperature`` 0 is greedy. Sampling draws from its own
    generator, so the training RNG is untouched.
    """
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    was_training = model.training
    model.eval()
    try:
        for _ in range(new_tokens):
            window = torch.tensor([ids[-context:]], device=device)
            logits = model(input_ids=window, use_cache=False).logits[0, -1].float().cpu()
            if temperature == 0:
                next_id = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(next_id)
    finally:
        model.train(was_training)
    return ids
