"""`tierwise export RUN_DIR OUT_DIR [--dtype bf16|fp32] [--merge-lora]`: a from_pretrained folder
from a `tierwise train` run's latest checkpoint.

One process reads the checkpoint by parameter name (``tierwise.checkpoint.reader``: any world
size, chunk size or tiers the run had) one parameter at a time and streams the values into
safetensors shards of at most 5 GB, so it holds at most one output shard plus one parameter
(LoRA merging also holds the adapters, which are small): [Note: export memory]. The model's config comes from the run's
``hf/config.json`` (written by `tierwise train`), with the dtype written recorded in it.

A LoRA run exports its adapters as PEFT writes them (``adapter_model.safetensors``,
``adapter_config.json``; load with ``PeftModel.from_pretrained``), or with ``--merge-lora`` a
plain model whose adapted weights are ``W + scaling · B @ A``, as PEFT's ``merge_and_unload``
computes them. A LoRA run without ``--from-pretrained`` had a randomly initialised base that
exists nowhere else, so its adapter export also writes that base, as a plain model folder in
``OUT_DIR/base``, which ``adapter_config.json`` names as its base model.

[Note: export memory]
Checkpoint files are read a parameter at a time (format 3 with ``os.preadv``, format 2
memory-mapped: pages a read touches stay in the process's resident memory until the file is
unmapped, so after each parameter the reader is released, ``CheckpointReader.release``), the next
parameter on a reader thread while this one is written ([Note: pipelined export]). The shard
writer's workers convert each tensor into its staging blocks and write them as they fill; the
blocks are the write window (``EXPORT_WINDOW_BYTES``), and a tensor is held until its last
piece is in a block. Nothing else holds model data, so peak memory is two parameters in fp32
(the one being written, the next one read) and the window, whatever the model size
(tests/hf/test_export_memory.py measures it).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierwise.checkpoint.manifest import CheckpointError
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.integrations.hf_save import DTYPES, record_dtype
from tierwise.integrations.safetensors_shards import save_safetensors
from tierwise.train.checkpoints import CHECKPOINTS, LATEST
from tierwise.train.errors import TrainError
from tierwise.train.lora import MODEL_FOLDER, PEFT_PREFIX, base_name
from tierwise.train.tokenizers import ByteTokenizer
from tierwise.weights.read_ahead import read_ahead
from tierwise.weights.safetensors_io import MAX_SHARD_BYTES, ShardedWriter

ADAPTER = "default"
"""The adapter name `tierwise train --lora` trains."""
BASE_FOLDER = "base"
"""Where a LoRA export without --merge-lora writes a base that exists nowhere else."""


def add_export_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write a Hugging Face (from_pretrained) folder from a `tierwise train` run",
        description="Write a folder AutoModelForCausalLM.from_pretrained loads (or, for a LoRA "
        "run, PEFT adapter files) from the latest checkpoint of a `tierwise train` run. One "
        "process, whatever world size the run had; memory: one parameter at a time.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of a run")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write (new or empty)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of the weights written (default fp32, the master weights)",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA run: merge the adapters into the base weights and write a "
        "plain model (default: write the adapter files, and the base in OUT_DIR/base "
        "when the run had no --from-pretrained)",
    )
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    try:
        out = export(args.run_dir, args.out_dir, dtype=args.dtype, merge_lora=args.merge_lora)
    except (TrainError, CheckpointError, OSError) as err:  # OSError: a full disk, a bad path
        print(f"tierwise export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def latest_checkpoint(run_dir: Path) -> Path:
    pointer = run_dir / CHECKPOINTS / LATEST
    if not pointer.is_file():
        raise TrainError(
            f"{run_dir}: no checkpoint in it (no {CHECKPOINTS}/{LATEST}); a run writes one at its "
            "end, at --stop-after and every --save-every steps"
        )
    return pointer.parent / pointer.read_text().strip()


def export(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    merge_lora: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the export of ``run_dir`` into ``out_dir`` in safetensors shards of at most
    ``max_shard_bytes`` (a larger parameter gets a shard of its own); return ``out_dir``."""
    run, out = Path(run_dir), Path(out_dir)
    model_folder = run / MODEL_FOLDER
    if not (model_folder / "config.json").is_file():
        raise TrainError(
            f"{run}: no {MODEL_FOLDER}/config.json; give the --out directory of a `tierwise train` "
            "run (runs from before `tierwise export` existed lack it)"
        )
    checkpoint = latest_checkpoint(run)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TrainError(f"OUT_DIR {out} exists and is not empty; choose a new directory")
    lora = _read_json(model_folder / "adapter_config.json")
    if merge_lora and lora is None:
        raise TrainError(f"--merge-lora: {run} trained no LoRA adapters (it has no --lora)")
    # the checksums are computed by the reads themselves and checked before any shard is
    # named ([Note: hashing while reading])
    reader = CheckpointReader(checkpoint, check_on_open=False)
    out.mkdir(parents=True, exist_ok=True)
    try:
        options = _options(run)
        if lora is not None and not merge_lora:
            base = _base_path(options, lora)
            if not base:  # a random base: write it, as the adapters need it
                base = str((out / BASE_FOLDER).resolve())
                _write_model(
                    reader,
                    Path(base),
                    model_folder,
                    lora,
                    DTYPES[dtype],
                    max_shard_bytes,
                    merge=False,
                )
            reader.check_all()
            _write_adapters(reader, out, lora, DTYPES[dtype], base)
        else:
            _write_model(reader, out, model_folder, lora, DTYPES[dtype], max_shard_bytes)
        _copy_tokenizer(options, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        reader.close()
    return out


def _base_path(options: dict, lora: dict) -> str | None:
    """The --from-pretrained directory of a LoRA run, absolute: as `tierwise train` recorded it
    (runs before it did so: resolved from here)."""
    given = options.get("from_pretrained")
    if not given:
        return None
    recorded = lora.get("base_model_name_or_path") or ""
    return recorded if Path(recorded).is_absolute() else str(Path(given).resolve())


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _options(run: Path) -> dict:
    return _read_json(run / "options.json") or {}


def _write_model(
    reader: CheckpointReader,
    out: Path,
    model_folder: Path,
    lora: dict | None,
    dtype: torch.dtype,
    max_shard_bytes: int,
    *,
    merge: bool = True,
) -> None:
    """The (for LoRA: base, merged when ``merge``) model as a from_pretrained folder ``out``;
    the shards are named only once the checkpoint's checksums, hashed by the reads, have
    passed ([Note: hashing while reading])."""
    adapters = {}
    if lora is not None and merge:  # small, out of the file's order: checked by ``reader``
        adapters = _adapters(CheckpointReader(reader.path, check_on_open=False, hash_reads=False))
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name in reader.names():
        out_name = _out_name(name) if lora is not None else name
        if out_name is not None:
            sizes[out_name] = reader.numel(name) * dtype.itemsize
    names = [n for n in reader.names() if lora is None or _out_name(n) is not None]
    writer = ShardedWriter(out, sizes, max_bytes=max_shard_bytes)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="tierwise-export-read") as pool:
            values = read_ahead(pool, lambda name: _read_released(reader, name), names)
            for name, value in zip(names, values, strict=True):
                out_name = name
                if lora is not None:
                    out_name = _out_name(name)
                    module = name.removeprefix(PEFT_PREFIX).removesuffix(".weight")
                    if module.endswith(".base_layer") and name.endswith(".weight"):
                        value = _merged(value, adapters, module.removesuffix(".base_layer"), lora)
                writer.add(out_name, value, dtype)  # converted by the writer's workers
                del value
        reader.check_all()  # what the rank files hold besides is read (and hashed) here
        writer.close()
    except BaseException:
        writer.abort()
        raise
    shutil.copyfile(model_folder / "config.json", out / "config.json")
    record_dtype(out, dtype)


def _read_released(reader: CheckpointReader, name: str) -> torch.Tensor:
    """``name``'s fp32 master, the reader's files released after it ([Note: export memory]);
    on the read-ahead thread, the only one using the reader meanwhile."""
    value = reader.tensor(name)
    reader.release()
    return value


def _out_name(name: str) -> str | None:
    """The plain model's name of a LoRA run's base parameter (None: an adapter)."""
    if ".lora_" in name:
        return None
    if not name.startswith(PEFT_PREFIX):
        raise TrainError(f"checkpoint parameter {name} is not under {PEFT_PREFIX!r}")
    return base_name(name)


def _adapters(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every LoRA tensor (small next to the base), by name."""
    out = {}
    for name in reader.names():
        if ".lora_" in name:
            kind = name.rsplit(".lora_", 1)[1].split(".", 1)[0]
            if kind not in ("A", "B"):
                raise TrainError(
                    f"--merge-lora: {name} is a lora_{kind} adapter; only linear-layer LoRA "
                    "(lora_A, lora_B) can be merged"
                )
            out[name] = reader.tensor(name)
    return out


def _merged(
    weight: torch.Tensor, adapters: dict[str, torch.Tensor], module: str, lora: dict
) -> torch.Tensor:
    """``weight + (B @ A) · scaling`` in PEFT's order (transposed for fan_in_fan_out)."""
    a_name = f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER}.weight"
    b_name = f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER}.weight"
    if a_name not in adapters:
        return weight  # not an adapted layer
    if lora.get("use_dora"):
        raise TrainError("--merge-lora: DoRA adapters are not supported; export without merging")
    rank = lora["r"]
    scaling = lora["lora_alpha"] / (math.sqrt(rank) if lora.get("use_rslora") else rank)
    delta = adapters[b_name] @ adapters[a_name]
    if lora.get("fan_in_fan_out"):
        delta = delta.T
    return weight + delta * scaling


def _write_adapters(
    reader: CheckpointReader, out: Path, lora: dict, dtype: torch.dtype, base: str
) -> None:
    """The files ``PeftModel.save_pretrained`` writes: adapter weights without the adapter name."""
    tensors = {
        name.replace(f".{ADAPTER}.", "."): reader.tensor(name).to(dtype).contiguous()
        for name in reader.names()
        if ".lora_" in name
    }
    save_safetensors(tensors, out / "adapter_model.safetensors")
    config = dict(lora)
    config["base_model_name_or_path"] = base
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(options: dict, out: Path) -> None:
    """The run's Hugging Face tokenizer, or, for a run on the default byte tokenizer, that one
    as a Hugging Face tokenizer ([Note: the byte tokenizer as a Hugging Face tokenizer]), so
    ``AutoTokenizer.from_pretrained(out)`` works on every export."""
    source = options.get("tokenizer") or options.get("from_pretrained")
    if not source or not any(
        (Path(source) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        ByteTokenizer().save_pretrained(out)  # what the run trained on (see run._train)
        return
    import transformers

    transformers.AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
