"""The process's peak RSS of `tierwise train` runs against the budgets they were given (issue 36:
"the budget you give is the memory the process uses").

Each case runs `tierwise train --json` in a fresh process on a CPU (2 steps, batch 1, seq 64,
random init on the meta device unless it loads a checkpoint) and reads the summary event: the
process's peak RSS (VmHWM), the plan's prediction (``predicted_process_bytes``: RSS before the
model was built plus each RAM ledger entry at its budget) and the ledger. The first case is the
demo model with no budgets: the issue's target subtracts its peak, so what remains is what the
model costs. Per case one JSON line:

- ``over_demo_bytes``: peak RSS minus the demo run's;
- ``budget_bytes``: host + device budgets (both RAM on a CPU) and ``activation_bytes``: the
  plan's activation allowance, or the saved activations' measured peak where the plan has none;
- ``ratio``: ``over_demo_bytes / (budget_bytes + activation_bytes)``; the issue's target is
  ``over_demo_bytes <= 1.10 * budget_bytes + activation_bytes`` (``target_met``);
- ``predicted_bytes`` / ``peak_rss_bytes``: the summary's own comparison.

Sizes are chosen to finish on the 2-core, shared CPU machine under ~4 GB: a 25.3M-parameter
GPT-2 shape (8 layers of 512, byte-level vocabulary) rather than 350m, whose random-init run did
not finish in 900 s under load in the last session.

    /work/tools/py bench/rss_budget.py [--cases demo,host,...] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit  # noqa: E402

MODEL = {  # GPT-2 shape: 8 x 12 x 512^2 = 25.2M parameters in the blocks
    "model_type": "gpt2",
    "n_embd": 512,
    "n_layer": 8,
    "n_head": 8,
    "vocab_size": 258,
    "n_positions": 256,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
COMMON = ["--steps", "2", "--batch", "1", "--seq", "64", "--sample-tokens", "0"]
MIB = 1 << 20


def cases(work: Path) -> dict[str, list[str]]:
    config = work / "model.json"
    nvme = str(work / "nvme")
    model = ["--model-config", str(config)]
    on_host = ["--param-placement", "host", "--optimizer-placement", "host"]
    on_nvme = ["--param-placement", "nvme", "--optimizer-placement", "nvme", "--nvme-path", nvme]
    return {
        "demo": [],
        "host": [*model, *on_host, "--host-memory", "448MiB", "--device-memory", "64MiB"],
        "int8": [
            *model,
            *on_host,
            "--optimizer-states",
            "int8",
            "--host-memory",
            "320MiB",
            "--device-memory",
            "64MiB",
        ],
        "nvme": [*model, *on_nvme, "--host-memory", "128MiB", "--device-memory", "64MiB"],
        "lora": [*model, *on_host, "--lora", "8", "--host-memory", "192MiB"],
        "act_nvme": [
            *model,
            *on_host,
            "--activation-offload",
            "nvme",
            "--nvme-path",
            nvme,
            "--host-memory",
            "448MiB",
            "--device-memory",
            "64MiB",
        ],
        "pretrained_nvme": [
            "--from-pretrained",
            str(work / "checkpoint"),
            *on_nvme,
            "--host-memory",
            "64MiB",
            "--device-memory",
            "64MiB",
        ],
    }


def write_inputs(work: Path, wanted: list[str]) -> None:
    (work / "model.json").write_text(json.dumps(MODEL))
    (work / "nvme").mkdir(exist_ok=True)
    if "pretrained_nvme" in wanted and not (work / "checkpoint").is_dir():
        script = (
            "import json, sys, torch, transformers as tf\n"
            "config = tf.GPT2Config(**json.load(open(sys.argv[1])))\n"
            "torch.manual_seed(0)\n"
            "tf.GPT2LMHeadModel(config).save_pretrained(sys.argv[2])\n"
        )
        subprocess.run(
            [sys.executable, "-c", script, str(work / "model.json"), str(work / "checkpoint")],
            check=True,
        )


def run(args: list[str], out: Path, timeout: float) -> dict:
    command = [sys.executable, "-m", "tierwise.cli", "train", "--json", *COMMON]
    command += [*args, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = [e for e in events if e.get("event") == "summary"]
    if done.returncode != 0 or not summary:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    plan = json.loads((out / "plan.json").read_text())
    return {**summary[-1], "plan": plan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated case names")
    parser.add_argument("--work", default=None, help="directory for inputs and runs")
    parser.add_argument("--timeout", type=float, default=900)
    options = parser.parse_args()
    work = Path(options.work or tempfile.mkdtemp(prefix="rss_budget_"))
    work.mkdir(parents=True, exist_ok=True)
    table = cases(work)
    wanted = options.cases.split(",") if options.cases else list(table)
    if "demo" not in wanted:
        wanted.insert(0, "demo")
    write_inputs(work, wanted)
    demo_peak = None
    for name in wanted:
        try:
            result = run(table[name], work / f"run-{name}", options.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            emit(bench="rss_budget", case=name, error=str(err)[-600:])
            continue
        peak = result["peak_rss_bytes"]
        if name == "demo":
            demo_peak = peak
        budgets = result["budgets"]
        budget = sum(v for v in (budgets.get("host"), budgets.get("device")) if v)
        saved = (result["memory"] or {}).get("saved_activations", {})
        allowance = result["plan"].get("activation_allowance")
        activation = allowance if allowance is not None else saved.get("peak_bytes", 0)
        over = None if demo_peak is None else peak - demo_peak
        emit(
            bench="rss_budget",
            case=name,
            args=" ".join(table[name]).replace(str(work), "WORK"),
            peak_rss_bytes=peak,
            over_demo_bytes=over,
            host_budget_bytes=budgets.get("host"),
            device_budget_bytes=budgets.get("device"),
            budget_bytes=budget,
            activation_bytes=activation,
            activation_from="plan" if allowance is not None else "measured saved peak",
            ratio=None if not over or not budget else round(over / (budget + activation), 3),
            target_met=None if name == "demo" else over <= 1.10 * budget + activation,
            predicted_bytes=result["predicted_process_bytes"],
            peak_over_predicted_mib=round((peak - result["predicted_process_bytes"]) / MIB, 1)
            if result["predicted_process_bytes"]
            else None,
            ledger_host_peaks_mib={
                k: round(v["peak_bytes"] / MIB, 1)
                for k, v in (result["memory"] or {}).items()
                if v["memory"] == "host" and v["peak_bytes"]
            },
            wall_s=round(result["wall_s"], 1),
            os_pid=os.getpid(),
        )


if __name__ == "__main__":
    main()
