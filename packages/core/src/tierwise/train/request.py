"""The inputs of one `tierwise train` invocation, checked before anything runs: the flags, the
config, the run directory (a new one, or the run to resume) and the plugins they need."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierwise.config import Config
from tierwise.plugins import get_plugin_host
from tierwise.train.errors import TrainError
from tierwise.train.options import RUN_IDENTITY, TrainOptions

# the run directory's files
OPTIONS_FILE = "options.json"
CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
PLOT_FILE = "memory.png"
TRAINING_PLOT_FILE = "training.png"
NOT_PERSISTED = ("resume", "out", "stop_after", "json")
"""Options that belong to one invocation, not to the run."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """The validated inputs of one invocation."""

    options: TrainOptions
    """What to train and how."""
    config: Config
    """The engine's Config (device budget still None when the default applies)."""
    device_memory_given: bool
    """Whether --device-memory (or a config file, or the resumed run) set the device budget."""
    run_dir: Path
    """Where outputs go (not created yet)."""
    resuming: bool
    """Continue the run in run_dir."""
    sample_given: bool = False
    """Whether --sample-tokens was given: the final sample runs however long it takes (and a
    --resume of a finished run only samples)."""


def with_accumulation(config_given: dict[str, Any], options: TrainOptions) -> dict[str, Any]:
    """The config overrides, telling the engine how many backwards make a step: in-backward
    updates run in the last one ([Note: speculative updates])."""
    return {"accumulation_steps": options.grad_accum, **config_given}


def resolve(train_given: dict[str, Any], config_given: dict[str, Any]) -> Request:
    """Check every flag and file; raise TrainError/ConfigError with one line for people."""
    resume = train_given.get("resume")
    if resume is None:
        options = TrainOptions(**train_given)
        config = Config.from_any(options.config, **with_accumulation(config_given, options))
        run_dir = Path(options.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise TrainError(
                f"--out {run_dir} already exists and is not empty; pass --resume {run_dir} to "
                "continue that run, or choose another --out"
            )
        given_budget = "device_memory" in config_given or config.device_memory is not None
        return Request(
            options=options,
            config=config,
            device_memory_given=given_budget,
            run_dir=run_dir,
            resuming=False,
            sample_given="sample_tokens" in train_given,
        )
    run_dir = Path(resume)
    if not (run_dir / OPTIONS_FILE).is_file():
        raise TrainError(
            f"--resume {run_dir}: not a tierwise train run directory (no {OPTIONS_FILE}); give "
            "the --out directory of an earlier run"
        )
    saved = json.loads((run_dir / OPTIONS_FILE).read_text())
    saved_config = json.loads((run_dir / CONFIG_FILE).read_text())
    for name in RUN_IDENTITY:
        if name in train_given and _plain(train_given[name]) != saved.get(name):
            if name == "steps":
                raise TrainError(
                    f"--resume {run_dir} cannot change --steps from {saved['steps']} to "
                    f"{train_given['steps']}: the learning-rate warmup and cosine decay span "
                    "--steps, so the steps already taken belong to another schedule; start a new "
                    f"run (--out) or resume with --steps {saved['steps']}"
                )
            flag = "--" + name.replace("_", "-")
            raise TrainError(
                f"--resume {run_dir} continues the run as it was started with {flag} "
                f"{saved.get(name)!r}; it cannot change it to {train_given[name]!r}: start a new "
                "run with another --out instead"
            )
    if config_given.get("precision", saved_config["precision"]) != saved_config["precision"]:
        raise TrainError(
            f"--resume {run_dir} continues a --precision {saved_config['precision']} run; start a "
            "new run with another --out to change the precision"
        )
    merged = {k: v for k, v in saved.items() if k not in NOT_PERSISTED}
    if merged.get("from_pretrained") or merged.get("model_config"):  # runs from before the
        merged["model"] = merged["size"] = None  # presets stopped being recorded for them
    merged.update(train_given)
    merged["out"] = str(run_dir)
    options = TrainOptions(**merged)
    config = Config.from_any(saved_config, **config_given)
    return Request(
        options=options,
        config=config,
        device_memory_given=True,
        run_dir=run_dir,
        resuming=True,
        sample_given="sample_tokens" in train_given,
    )


def _plain(value: Any) -> Any:
    """A value as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def check_plugins(config: Config) -> None:
    """An NVMe placement needs the NVMe tier and an existing directory."""
    wants_nvme = config.nvme_path is not None or "nvme" in (
        config.param_placement,
        config.optimizer_placement,
        config.activation_offload,
    )
    if not wants_nvme:
        return
    if "nvme" not in get_plugin_host().tier_classes():
        raise TrainError(
            "--nvme-path needs the NVMe tier from the tierwise-nvme plugin, which is not installed "
            "(or is blocked by TIERWISE_DISABLE_PLUGINS): pip install tierwise-nvme "
            "(in this repo: pip install -e packages/offload-nvme)"
        )
    if Path(config.nvme_path).exists() and not Path(config.nvme_path).is_dir():
        raise TrainError(
            f"--nvme-path {config.nvme_path} is a file, not a directory: give a directory on a "
            "fast local disk"
        )
    if not Path(config.nvme_path).is_dir():
        raise TrainError(
            f"--nvme-path {config.nvme_path}: no such directory; create it on a fast local disk"
        )
    try:  # before the data and the model are read: a read-only mount fails in a second
        fd, probe = tempfile.mkstemp(prefix=".tierwise-write-probe-", dir=config.nvme_path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise TrainError(
            f"--nvme-path {config.nvme_path} is not writable ({err.strerror or err}): give a "
            "writable directory on a fast local disk, or remount it read-write / fix its "
            "permissions"
        ) from None


__all__ = [
    "CONFIG_FILE",
    "NOT_PERSISTED",
    "OPTIONS_FILE",
    "PLAN_FILE",
    "PLOT_FILE",
    "TRAINING_PLOT_FILE",
    "Request",
    "check_plugins",
    "resolve",
    "with_accumulation",
]
