"""TrainOptions: what `tierwise train` was asked to do (beyond the engine's Config), validated."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any

from tierwise.model_presets import FAMILIES, ModelError, check_size
from tierwise.train.errors import TrainError

FINITE_NUMBERS = (
    "lr",
    "lr_floor",
    "weight_decay",
    "clip",
    "save_minutes",
    "temperature",
    "lora_alpha",
)
"""Float options checked to be finite first (``nan`` passes every comparison the checks below
make, and reached the optimizer as a traceback)."""

DEFAULT_SAVE_EVERY = 100
"""Checkpoint interval in steps when --save-every is not given."""

DEFAULT_MODEL, DEFAULT_SIZE = "gpt2", "small"
"""The preset when no model is named (a 0.86M-parameter demo model with the byte tokenizer)."""

LR_RANDOM_INIT = 3e-3
"""A small model trained from scratch for a few hundred steps learns fast at this rate."""
LR_FULL_FINE_TUNE = 2e-5
"""Fine-tuning every weight of a pretrained LLM: the 1e-5..2e-5 of common full fine-tuning
recipes (Alpaca, Llama and Mistral instruction tuning), small enough to keep what pretraining
learned."""
LR_LORA = 2e-4
"""LoRA adapters: ten times the full rate (the 1e-4..2e-4 of the LoRA and QLoRA papers'
recipes), as an adapter's update is scaled by alpha/rank and starts from B = 0, while the frozen
base cannot drift."""


def default_lr(options: TrainOptions) -> float:
    """The learning rate a run gets when --lr is not given."""
    if options.from_pretrained is None:
        return LR_RANDOM_INIT
    return LR_LORA if options.lora else LR_FULL_FINE_TUNE


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """One `tierwise train` run. The engine's own settings are a ``tierwise.Config`` beside it."""

    # -- model ------------------------------------------------------------------------------
    model: str | None = None
    """Preset family: gpt2, opt, llama or mixtral (random init); default: gpt2, unless
    --from-pretrained or --model-config names the model."""
    size: str | None = None
    """Preset size of the family (default: small): tiny, small, 125m, 350m, 1b, 3b, 7b, 13b, or a
    family's published size (gpt2 medium..20b, opt 1.3b..175b, llama 8b and 70b, mixtral 8x7b); a
    name a family published has that model's exact shape (llama 8b is Llama-3.1-8B, llama 1b
    Llama-3.2-1B); the same choices as ``tierwise profile`` and ``tierwise plan``."""
    model_config: str | None = None
    """A Hugging Face config.json to build the model from (random init) instead of a preset."""
    from_pretrained: str | None = None
    """A local Hugging Face checkpoint directory to fine-tune (uses its tokenizer when it has one)."""

    lora: int | None = None
    """Train LoRA adapters of this rank (PEFT) on the frozen model instead of every weight."""
    lora_alpha: float | None = None
    """LoRA scaling: updates are multiplied by alpha / rank; default: 2 × --lora."""
    lora_targets: str | None = None
    """Comma-separated module names LoRA adapts (e.g. q_proj,v_proj); default: PEFT's choice
    for the model type."""

    # -- data -------------------------------------------------------------------------------
    data: tuple[str, ...] = ()
    """Text files, quoted globs, .jsonl files (a 'text' field, chat 'messages', or 'prompt' and
    'completion') or a datasets save_to_disk directory; none: the Python standard library's own
    source."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory; default: UTF-8 bytes (no download)."""
    train_on_prompt: bool = False
    """Take the loss on the prompt and user turns of instruction data too (default: only on the
    completion and the assistant turns)."""
    pack: bool | None = None
    """Pack several documents into each row, each attending only to itself (--no-pack: one
    document per row, padded); default: pack when the model can keep them apart."""
    token_cache: str | None = None
    """Directory of the on-disk token cache (the data tokenised once, reused by later runs and
    resumes); default: tokens/ in $TIERWISE_CACHE_DIR, else ~/.cache/tierwise/tokens."""

    # -- training ---------------------------------------------------------------------------
    steps: int = 200
    """Optimizer steps of the whole run (the learning-rate schedule spans them)."""
    stop_after: int | None = None
    """Stop after this many steps (a checkpoint is written); --resume finishes the run."""
    batch: int = 8
    """Sequences per micro-batch on each rank."""
    seq: int = 128
    """Tokens per sequence."""
    grad_accum: int = 1
    """Micro-batches accumulated into each optimizer step."""
    lr: float | None = None
    """Peak learning rate (AdamW); default: 3e-3 for a random-init model, 2e-5 to fine-tune
    every weight of --from-pretrained, 2e-4 for its LoRA adapters."""
    warmup: int | None = None
    """Warmup steps before the cosine decay; default: 10% of --steps."""
    lr_floor: float = 0.1
    """The cosine ends at this fraction of --lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: int = 0
    """Seed of the model init, the batch order and sampling."""

    # -- outputs ----------------------------------------------------------------------------
    out: str | None = None
    """Run directory for plan, metrics, checkpoints and plot; default: runs/train-<time>."""
    resume: str | None = None
    """Continue the run in this directory from its latest checkpoint, exactly."""
    save_every: int | None = None
    """Write a checkpoint every this many steps (and at the end, at --stop-after and on Ctrl-C);
    default: 100."""
    save_minutes: float = 30.0
    """Also write one when this many minutes passed since the last (0: only by steps)."""
    eval_every: int | None = None
    """Held-out loss every this many steps (and at the end); default: --steps/4."""
    eval_batches: int = 4
    """Micro-batches in each eval."""
    sample_tokens: int = 200
    """Tokens generated at the end (0: no sample)."""
    temperature: float = 0.8
    """Sampling temperature of the final sample (0: greedy)."""
    prompt: str | None = None
    """Text the final sample starts from; default: the opening (or the prompt) of the first
    held-out document."""
    config: str | None = None
    """A .toml or .json file of tierwise.Config fields (flags override it)."""
    json: bool = False
    """Print one JSON object per line instead of the progress bar and tables."""

    def __post_init__(self) -> None:
        def fail(flag: str, message: str) -> None:
            raise TrainError(f"--{flag} {getattr(self, flag.replace('-', '_'))!r}: {message}")

        object.__setattr__(self, "data", tuple(self.data))
        for name in FINITE_NUMBERS:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                fail(name.replace("_", "-"), "must be a finite number")
        if self.model_config and self.from_pretrained:
            raise TrainError("give either --model-config or --from-pretrained, not both")
        if self.model_config or self.from_pretrained:
            if self.size is not None:  # --model is checked against the checkpoint's type
                given = "--model-config" if self.model_config else "--from-pretrained"
                raise TrainError(
                    f"--size picks a preset's shape; {given} already gives the model's: leave "
                    "--size out"
                )
        else:
            object.__setattr__(self, "model", self.model or DEFAULT_MODEL)
            object.__setattr__(self, "size", self.size or DEFAULT_SIZE)
        if self.lr is None:
            object.__setattr__(self, "lr", default_lr(self))
        if self.model is not None and self.model not in FAMILIES:
            raise TrainError(
                f"unknown --model {self.model!r}: choose one of {', '.join(FAMILIES)}, "
                "or give --model-config path/to/config.json"
            )
        if self.lora is not None and self.lora < 1:
            fail("lora", "the adapter rank must be at least 1")
        if self.lora is None and (self.lora_alpha is not None or self.lora_targets is not None):
            raise TrainError("--lora-alpha and --lora-targets need --lora R (the adapter rank)")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            fail("lora-alpha", "must be positive")
        if self.size is not None and self.model_config is None and self.from_pretrained is None:
            try:
                check_size(self.model or "gpt2", self.size)
            except ModelError as err:
                raise TrainError(str(err)) from None
        for flag in ("steps", "batch", "grad-accum", "eval-batches"):
            if getattr(self, flag.replace("-", "_")) < 1:
                fail(flag, "must be at least 1")
        if self.seq < 2:
            fail("seq", "must be at least 2 tokens")
        if self.lr <= 0:
            fail("lr", "must be positive")
        if not 0 <= self.lr_floor <= 1:
            fail("lr-floor", "must be a fraction of --lr between 0 and 1")
        if self.weight_decay < 0:
            fail("weight-decay", "must be ≥ 0")
        if self.clip < 0:
            fail("clip", "must be ≥ 0 (0 turns clipping off)")
        if self.warmup is not None and not 0 <= self.warmup < self.steps:
            fail("warmup", f"must be between 0 and --steps - 1 ({self.steps - 1})")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            fail("stop-after", f"must be between 1 and --steps ({self.steps})")
        for flag in ("save-every", "eval-every"):
            value = getattr(self, flag.replace("-", "_"))
            if value is not None and value < 1:
                fail(flag, "must be at least 1")
        if self.save_minutes < 0:
            fail("save-minutes", "must be ≥ 0 (0: checkpoints by step count only)")
        if self.sample_tokens < 0:
            fail("sample-tokens", "must be ≥ 0")
        if self.temperature < 0:
            fail("temperature", "must be ≥ 0 (0 is greedy)")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.steps // 10

    @property
    def checkpoint_interval(self) -> int:
        return self.save_every if self.save_every is not None else DEFAULT_SAVE_EVERY

    @property
    def eval_interval(self) -> int:
        return self.eval_every if self.eval_every is not None else max(1, self.steps // 4)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


RUN_IDENTITY = (
    "model",
    "size",
    "model_config",
    "from_pretrained",
    "data",
    "tokenizer",
    "steps",
    "batch",
    "seq",
    "grad_accum",
    "lr",
    "warmup",
    "lr_floor",
    "weight_decay",
    "clip",
    "seed",
    "lora",
    "lora_alpha",
    "lora_targets",
    "train_on_prompt",
    "pack",
)
"""Options a resumed run must keep: changing them would not continue the same run."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of the dataclasses it inherits (Config's
    policies), one line (for --help)."""
    docs: dict[str, str] = {}
    for declaring in reversed(cls.__mro__):
        if dataclasses.is_dataclass(declaring):
            docs.update(_own_field_docs(declaring))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs
