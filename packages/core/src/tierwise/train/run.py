"""`tierwise train`: validate, build, plan, train in a plain PyTorch loop, report.

Nothing is written before every input has been checked (``request``, ``prepare``) and the engine
has accepted the plan; then the run directory gets options.json, config.json, plan.json,
metrics.jsonl, checkpoints/ and memory.png. ``Trainer`` runs the steps and holds the loop's state.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tierwise
from tierwise.config import ConfigError
from tierwise.model_presets import ModelError
from tierwise.planning.host_share import rank_host_share
from tierwise.train import checkpoints, lora
from tierwise.train.blocks import BlockSampler, to_device
from tierwise.train.distributed import (
    World,
    barrier,
    close_world,
    init_world,
    launched_by_torchrun,
    mean_over_ranks,
    same_on_all_ranks,
)
from tierwise.train.errors import RunFailed, TrainError
from tierwise.train.interrupts import Agreement, StopRequest, exit_status
from tierwise.train.metrics import MetricsLog, counter_delta, read_metrics, step_record
from tierwise.train.options import TrainOptions
from tierwise.train.plot import plot_memory, plot_training
from tierwise.train.prepare import PreparedRun, prepare_run
from tierwise.train.report import Console
from tierwise.train.request import (
    CONFIG_FILE,
    OPTIONS_FILE,
    PLAN_FILE,
    PLOT_FILE,
    TRAINING_PLOT_FILE,
    Request,
    check_plugins,
    resolve,
)
from tierwise.train.sample import SAMPLE_BUDGET_S, SampleTooSlow, evaluate, generate, printable
from tierwise.train.summary import RunSummary, resume_hint
from tierwise.train.trace import StepTracer


def main(train_given: dict[str, Any], config_given: dict[str, Any]) -> int:
    """Run `tierwise train` with the flags the user gave; return the exit code."""
    try:
        return train(train_given, config_given)
    except (TrainError, ModelError, ConfigError) as err:
        _print_error(err, every_rank=False)
        return 2
    except (RunFailed, OSError) as err:  # a disk failed under the run: one line, no traceback
        _print_error(err, every_rank=True)
        return 1
    except KeyboardInterrupt:  # outside the training loop ([Note: stopping between steps])
        print(
            "tierwise train: interrupted (outside the training steps; checkpoints written so "
            "far are kept)",
            file=sys.stderr,
        )
        return exit_status(signal.SIGINT)


def _print_error(err: BaseException, *, every_rank: bool) -> None:
    """One line on stderr.

    [Note: an error is printed once under torchrun]
    Every rank checks the same flags, files and plan, so a bad input fails on all of them with
    the same message: rank 0 alone prints it (torchrun still reports every rank's exit code). A
    failure of the run itself (a disk under the NVMe tier, a checkpoint write) belongs to the
    rank it happened on: each such rank prints it, naming itself.
    """
    rank = int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0
    if rank != 0 and not every_rank:
        return
    where = f" (rank {rank})" if rank else ""
    print(f"tierwise train: error{where}: {err}", file=sys.stderr)


# -- the run ------------------------------------------------------------------------------------
def train(train_given: dict[str, Any], config_given: dict[str, Any]) -> int:
    request = resolve(train_given, config_given)
    check_plugins(request.config)
    world = init_world(request.config.device)
    try:
        console = Console(enabled=world.is_main, json_mode=request.options.json)
        run_dir = same_on_all_ranks(request.run_dir, world)
        prepared = prepare_run(request, world, console)
        trainer = Trainer(prepared, request=request, world=world, console=console, run_dir=run_dir)
        return trainer.run()
    finally:
        close_world(world)


class Trainer:
    """One `tierwise train` run on this rank, from a prepared model: writes the run directory,
    resumes, steps until the last step or a stop request (evaluating and checkpointing on the
    way), then samples, plots and prints the summary."""

    def __init__(
        self,
        prepared: PreparedRun,
        *,
        request: Request,
        world: World,
        console: Console,
        run_dir: Path,
    ) -> None:
        self.options: TrainOptions = request.options
        self.resuming = request.resuming
        self.world, self.console, self.run_dir = world, console, run_dir
        self.device = torch.device(world.device)
        self.prepared = prepared
        self.model, self.optimizer = prepared.model, prepared.optimizer
        self.scheduler, self.engine = prepared.scheduler, prepared.engine
        self.budgets = {
            "device": prepared.config.device_memory,
            # this rank's ledger is against its share: [Note: a rank's host share]
            "host": rank_host_share(
                prepared.config.host_memory,
                self.engine.hardware.ranks_per_node if self.engine.hardware else 1,
            ),
        }
        """Byte budgets per tier of this rank, as the summary and the memory plot show them."""
        self.step = 0
        """Optimizer steps taken (the resumed run's included)."""
        self.micro_step = 0
        """Batches drawn so far (``grad_accum`` per step): where the sampler goes on."""
        self.first_step = 0
        """The step this process started from."""
        stop_after = self.options.stop_after
        self.last_step = stop_after if stop_after is not None else self.options.steps
        """The step this process stops after (--stop-after, else --steps)."""
        self.trace_step = 0
        """The step whose memory is traced for the plot (after the engine's warm-up step)."""
        self.trace = None
        """The traced step's memory trace, once it ran."""
        self.tokens_per_step = (
            self.options.batch * self.options.seq * self.options.grad_accum * world.size
        )
        self.step_seconds: list[float] = []
        """Wall time of each step this process ran."""
        self.started = 0.0
        """``time.perf_counter()`` when the first step started."""
        self.sample_given = request.sample_given
        """--sample-tokens was given: sample however long it takes."""
        self.sampler: BlockSampler | None = None
        self.metrics: MetricsLog | None = None
        """metrics.jsonl (rank 0 only)."""
        self.agreement: Agreement | None = None
        """Agrees across ranks on stopping and on time-due checkpoints."""

    def run(self) -> int:
        """Train and report; the exit code."""
        self._write_run_files()
        plan = self.engine.plan
        self.console.block("plan", plan.table(), plan=plan.to_dict())
        if self.resuming:
            self._resume()
        if self.step >= self.last_step:
            if self.sample_given and self.options.sample_tokens:  # the note of a skipped sample
                self._sample()
                return 0
            self.console.note(f"nothing to do: the run is at step {self.step} of {self.last_step}")
            return 0
        self._start_steps()
        stopped = self._train_steps()
        if stopped is not None:
            return self._stop(stopped)
        return self._finish()

    # -- before the first step ------------------------------------------------------------------
    def _write_run_files(self) -> None:
        """From here on, the run directory is ours (once every rank has checked its inputs)."""
        barrier(self.world)
        if not self.world.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.run_dir / OPTIONS_FILE, self.options.to_dict())
        _write_json(self.run_dir / CONFIG_FILE, self.prepared.config.to_dict())
        self.engine.plan.to_json(self.run_dir / PLAN_FILE)
        lora.describe_model(self.run_dir, self.model, base_path=self.options.from_pretrained)

    def _resume(self) -> None:
        """Load the newest intact checkpoint: values, schedule and where the data goes on."""
        loaded, fallback = checkpoints.latest(self.run_dir, self.world)
        if fallback:
            self.console.note(fallback)
        state = checkpoints.load(
            loaded, model=self.model, optimizer=self.optimizer, world=self.world
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.micro_step = state["step"], state["micro_step"]
        self.console.note(
            f"resumed {self.run_dir} at step {self.step} from {loaded.name}", step=self.step
        )

    def _start_steps(self) -> None:
        options, world = self.options, self.world
        self.sampler = BlockSampler(
            n_blocks=self.prepared.corpus.n_train,
            batch=options.batch,
            world=world.size,
            rank=world.rank,
            seed=options.seed,
        )
        self.metrics = MetricsLog(self.run_dir, keep_through=self.step) if world.is_main else None
        self.trace_step = min(self.step + 2, self.last_step)
        self.first_step = self.step
        self.console.start_progress(start=self.step, total=self.last_step)
        self.started = time.perf_counter()
        self.model.train()
        self.agreement = Agreement(world, options.save_minutes)

    # -- the steps ------------------------------------------------------------------------------
    def _train_steps(self) -> int | None:
        """Steps until the last one or a stop request; the signal that stopped the run, or None."""
        with StopRequest() as stop:
            try:
                while self.step < self.last_step:
                    self._one_step()
                    stopped = self._checkpoint_if_due(stop)
                    if stopped:
                        return stopped
            except OSError as err:  # the NVMe tier or a checkpoint write: the run cannot go on
                self.console.stop_progress()
                raise RunFailed(f"{err}; {resume_hint(self.run_dir)}") from None
        return None

    def _one_step(self) -> None:
        """Forward and backward over ``grad_accum`` batches, the optimizer step, the step's
        record, and the held-out loss when it is due."""
        tracer = None
        if self.world.is_main and self.step + 1 == self.trace_step:
            tracer = StepTracer(
                self.model, self.engine.stats, step=self.step + 1, budgets=self.budgets
            )
            tracer.mark("forward", "step starts")
        stats_before = self.engine.stats()
        times = {"data": 0.0, "forward": 0.0, "backward": 0.0}
        step_start = time.perf_counter()
        loss_sum = self._forward_backward(times, tracer)
        if tracer:
            tracer.backward_finished()
        t4 = time.perf_counter()
        grad_norm = None
        if self.options.clip > 0:
            grad_norm = float(tierwise.clip_grad_norm_(self.model, self.options.clip))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        times["optimizer"] = time.perf_counter() - t4
        times["total"] = time.perf_counter() - step_start
        self.step += 1
        if tracer:
            tracer.mark("optimizer", "optimizer step done")
        loss = mean_over_ranks(loss_sum / self.options.grad_accum, self.world)
        self._record(loss=loss, lr=lr, grad_norm=grad_norm, times=times, stats_before=stats_before)
        if tracer:
            self.trace = tracer.trace
        if self.step % self.options.eval_interval == 0 or self.step == self.last_step:
            self._evaluate()

    def _forward_backward(self, times: dict[str, float], tracer: StepTracer | None) -> float:
        """The step's micro-batches, their seconds added to ``times``; the sum of their losses."""
        loss_sum = 0.0
        for _ in range(self.options.grad_accum):
            t0 = time.perf_counter()
            rows = self.sampler.indices(self.micro_step)
            batch = to_device(self.prepared.corpus.train_batch(rows), self.device)
            self.micro_step += 1
            t1 = time.perf_counter()
            with tracer.forward() if tracer else contextlib.nullcontext():
                loss = self.model(**batch).loss
            t2 = time.perf_counter()
            (loss / self.options.grad_accum).backward()
            t3 = time.perf_counter()
            loss_sum += loss.item()
            times["data"] += t1 - t0
            times["forward"] += t2 - t1
            times["backward"] += t3 - t2
        return loss_sum

    def _record(self, *, loss: float, lr: float, grad_norm, times, stats_before) -> None:
        """The step's line: metrics.jsonl and the progress display."""
        record = step_record(
            step=self.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=self.tokens_per_step,
            times=times,
            stats=self.engine.stats(),
            stats_before=stats_before,
        )
        self.step_seconds.append(times["total"])
        if self.metrics:
            self.metrics.write(record)
        self.console.progress(record, last=self.step == self.last_step)

    def _evaluate(self) -> None:
        """The held-out loss, with the traffic it caused ([Note: the step after an eval moves
        less])."""
        before_eval = self.engine.stats()
        eval_loss = evaluate(
            self.model, self.prepared.corpus, self.options.batch, self.world, self.device
        )
        if self.metrics:  # [Note: the step after an eval moves less]
            moved = counter_delta(
                self.engine.stats().get("moved_bytes", {}), before_eval.get("moved_bytes", {})
            )
            self.metrics.write(
                {"kind": "eval", "step": self.step, "eval_loss": eval_loss, "moved_bytes": moved}
            )
        self.console.note(
            f"step {self.step}: held-out loss {eval_loss:.4f}", step=self.step, eval_loss=eval_loss
        )

    def _checkpoint_if_due(self, stop: StopRequest) -> int | None:
        """Agree on stopping, and save a checkpoint when one is due; the stop signal, if any."""
        stopped, time_due = self.agreement.after_step(stop)
        step = self.step
        if (
            step % self.options.checkpoint_interval == 0
            or step == self.last_step
            or stopped
            or time_due
        ):
            checkpoints.save(
                self.run_dir,
                step=step,
                model=self.model,
                optimizer=self.optimizer,
                world=self.world,
                loop_state={
                    "micro_step": self.micro_step,
                    "scheduler": self.scheduler.state_dict(),
                },
            )
            self.agreement.saved()
        return stopped

    # -- the end --------------------------------------------------------------------------------
    def _stop(self, stopped: int) -> int:
        """A signal stopped the run after a checkpoint: say how to resume."""
        self.console.stop_progress()
        if self.metrics:
            self.metrics.close()
        if self.world.is_main:
            print(
                f"tierwise train: {signal.Signals(stopped).name} after step {self.step} of "
                f"{self.last_step}; checkpoint written; resume with: tierwise train --resume "
                f"{self.run_dir}",
                file=sys.stderr,
            )
        return exit_status(stopped)

    def _finish(self) -> int:
        """The end of a run: sample, plot, summary."""
        self.console.stop_progress()
        elapsed = time.perf_counter() - self.started
        if self.metrics:
            self.metrics.close()
        if self.options.sample_tokens:
            self._sample()
        if not self.world.is_main:
            return 0
        self._summary(elapsed)
        return 0

    def _sample(self) -> None:
        """The final sample, from --prompt or the data's first held-out prompt; skipped with a
        note when its first token shows the rest would take over a minute (and --sample-tokens
        was not given)."""
        options, tokenizer = self.options, self.prepared.tokenizer
        prompt = (
            list(tokenizer.encode(options.prompt))
            if options.prompt is not None
            else self.prepared.corpus.sample_prompt(options.seq)
        )
        try:
            ids = generate(
                self.model,
                prompt,
                new_tokens=options.sample_tokens,
                temperature=options.temperature,
                context=options.seq,
                seed=options.seed,
                device=self.device,
                max_seconds=None if self.sample_given else SAMPLE_BUDGET_S,
            )
        except SampleTooSlow as slow:
            self.console.note(slow.note(self.run_dir), predicted_s=slow.predicted_s)
            return
        text = tokenizer.decode(ids)
        self.console.block(
            "sample",
            printable(text),
            text=text,
            temperature=options.temperature,
            prompt=tokenizer.decode(prompt),
        )

    def _summary(self, elapsed: float) -> None:
        """Rank 0: the memory and training plots, then the summary."""
        all_lines = read_metrics(self.run_dir / "metrics.jsonl")
        lines = [line for line in all_lines if line["kind"] == "train"]
        eval_lines = [line for line in all_lines if line["kind"] == "eval"]
        prepared, run_dir = self.prepared, self.run_dir
        title = (
            f"tierwise train: {prepared.model_name}, {prepared.n_params:,} parameters, "
            f"device {self.world.device}"
        )
        note = plot_memory(
            run_dir / PLOT_FILE, self.trace, lines, title=title, eval_lines=eval_lines
        )
        self.console.note(note or f"wrote {run_dir / PLOT_FILE}")
        note = plot_training(run_dir / TRAINING_PLOT_FILE, all_lines, title=title)
        self.console.note(note or f"wrote {run_dir / TRAINING_PLOT_FILE}")
        RunSummary(
            options=self.options,
            run_dir=run_dir,
            first_step=self.first_step,
            step=self.step,
            train_lines=lines,
            evals=[line["eval_loss"] for line in eval_lines],
            n_eval_blocks=prepared.corpus.n_eval,
            step_seconds=self.step_seconds,
            tokens_per_step=self.tokens_per_step,
            elapsed_s=elapsed,
            stats=self.engine.stats(),
            plan=self.engine.plan,
            budgets=self.budgets,
            fixed_memory=prepared.fixed_memory,
        ).show(self.console)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")
