"""Shared benchmark helpers: machine description, JSON lines, medians, a GPT-2 style model."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }


def emit(**fields) -> None:
    print(json.dumps({**fields, "machine": machine()}), flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def gpt2_model(
    *, n_embd: int, n_layer: int, n_head: int, vocab: int = 50257, positions: int = 1024
):
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


def batch(batch: int, seq: int, vocab: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def timed_step(model, optimizer, data, *, require_finite: bool = False) -> dict:
    """One training step, timed per phase (seconds); with ``require_finite`` a non-finite loss
    raises."""
    t0 = time.perf_counter()
    loss = model(**data).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    optimizer.zero_grad()
    if require_finite and not torch.isfinite(loss):
        raise RuntimeError(f"loss is {loss.item()}")
    return {
        "loss": loss.item(),
        "forward_s": t1 - t0,
        "backward_s": t2 - t1,
        "optimizer_step_s": t3 - t2,
        "backward_step_s": t3 - t1,
        "iteration_s": t3 - t0,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(worker, world: int, *args) -> list[tuple]:
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes (a free
    port on 127.0.0.1 for their process group) and return what each put on ``queue``, sorted:
    a tuple starting with its rank and ending with an error message or None. Waits at most
    30 minutes for each report."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    reports = sorted(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return reports


def one_pass_width_or_exit() -> int:
    """torch's vector width for the compiled int8 update ([Note: int8 Adam in one pass]); exits
    with the reason where the one pass is not used here (no compiler, or no bitwise match)."""
    from tierwise.optim import lowbit_kernel

    lib = lowbit_kernel.load()
    width = None if lib is None else lowbit_kernel.one_pass_width(lib)
    if width is None:
        raise SystemExit(
            "the one-pass int8 update is not used on this machine (no C compiler, or the "
            f"kernel is not bitwise torch's {torch.backends.cpu.get_cpu_capability()} fused "
            "AdamW): nothing to measure"
        )
    return width
