"""What the demo `tierwise train` run holds over a bare import, explained by the memory ledger
(issue 36, [Note: the memory ledger]).

Runs, each in a fresh process:
- ``run``: `tierwise train` on the default demo model (in-process through ``tierwise.cli.main``),
  recording each phase's RSS at its start and end and its own peak (VmHWM reset at its start):
  tokenizer, corpus, model build, setup, the training steps (evals included), the plots; with
  ``stats()["memory"]`` at the summary and the top-level modules the run imported;
- ``bare``: a process that only imports those same top-level modules.

Prints one JSON line per ledger entry (its peak) and one line with the figures: measured VmHWM,
bare-import VmHWM, the ledger's host-RAM bound (``peak_bound``), and what is left unexplained.

    /work/tools/py bench/memory_ledger.py [--steps 2] [-- extra train flags]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit  # noqa: E402


class Phases:
    """Each phase's RSS at its start and end and its own peak: VmHWM is reset at the start of
    a phase (``/proc/self/clear_refs``, Linux) and read at its end; phases may nest (setup's
    parts inside setup): the peak seen so far is folded into every open phase before a reset."""

    def __init__(self) -> None:
        from tierwise.tiers.ledger import process_memory

        self.read = process_memory
        self.records: dict[str, dict] = {}
        self.open: list[str] = []

    def _fold(self) -> dict:
        now = self.read()
        for name in self.open:
            record = self.records[name]
            record["peak"] = max(record.get("peak", 0), now["peak"])
        return now

    def begin(self, name: str) -> None:
        self._fold()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        self.records[name] = {"start_rss": self.read()["rss"]}
        self.open.append(name)

    def end(self, name: str) -> None:
        now = self._fold()
        self.open.remove(name)
        self.records[name]["end_rss"] = now["rss"]

    def wrap(self, owner, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def wrapped(*args, **kwargs):
            self.begin(name)
            try:
                return inner(*args, **kwargs)
            finally:
                self.end(name)

        setattr(owner, attribute, wrapped)


def _run_child(out: Path, train_args: list[str], modules: list[str] | None = None) -> None:
    from tierwise.tiers.ledger import process_memory

    if modules is not None:  # every module the run imports, before it: phases grow by data
        _import_all(modules)
    imports = process_memory()
    import tierwise.runtime.setup.pipeline as pipeline
    import tierwise.train.prepare as prepare
    import tierwise.train.run as run
    from tierwise.cli import main
    from tierwise.train.summary import RunSummary, predicted_process_bytes

    phases = Phases()
    phases.wrap(prepare, "load_tokenizer", "tokenizer")
    phases.wrap(prepare, "_token_cache", "corpus")
    phases.wrap(prepare, "_build_model", "build_model")
    phases.wrap(prepare, "_set_up", "setup")
    for part in ("profile_model", "make_plan", "allocate", "write_values", "start_engine"):
        phases.wrap(pipeline, part, f"setup.{part}")
    prepare_run, plot_memory = run.prepare_run, run.plot_memory
    seen = {}

    def prepared(*args, **kwargs):
        result = prepare_run(*args, **kwargs)
        phases.begin("train_steps")  # until the plots
        return result

    def plotting(*args, **kwargs):
        phases.end("train_steps")
        phases.begin("plots")
        return plot_memory(*args, **kwargs)

    def summary(self, console):
        phases.end("plots")
        seen["memory"] = self.stats["memory"]
        fixed = self.fixed_memory
        seen["before_setup"] = fixed.before_setup
        seen["setup_retained"] = fixed.setup_retained
        seen["predicted"] = predicted_process_bytes(fixed, self.stats["memory"])
        seen["whole_run_peak_of_phases"] = max(r["peak"] for r in phases.records.values())
        return show(self, console)

    run.prepare_run, run.plot_memory = prepared, plotting
    show = RunSummary.show
    RunSummary.show = summary
    rc = main(["train", *train_args])
    modules = list(sys.modules)  # in import order: importing them again in it works
    out.write_text(
        json.dumps(
            {"rc": rc, "imports": imports, "phases": phases.records, **seen, "modules": modules}
        )
    )


def _import_all(modules: list[str]) -> list[str]:
    """Import ``modules``; the names that failed."""
    import importlib

    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # a module that only imports inside its parent's context
            failed.append(name)
    return failed


def _bare_child(out: Path, modules: list[str]) -> None:
    from tierwise.tiers.ledger import process_memory

    failed = _import_all(modules)
    out.write_text(json.dumps({"memory": process_memory(), "failed": failed}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=["run", "bare"])
    parser.add_argument("--out")
    parser.add_argument("--modules")
    parser.add_argument("--steps", type=int, default=2)
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.child == "run":
        modules = json.loads(Path(args.modules).read_text()) if args.modules else None
        return _run_child(Path(args.out), rest, modules)
    if args.child == "bare":
        return _bare_child(Path(args.out), json.loads(Path(args.modules).read_text()))

    from tierwise.tiers.ledger import peak_bound

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_args = ["--steps", str(args.steps), "--sample-tokens", "0", "--out", str(tmp / "r")]
        train_args += rest
        me = [sys.executable, __file__]
        subprocess.run(
            [*me, "--child", "run", "--out", str(tmp / "run.json"), "--", *train_args],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        run = json.loads((tmp / "run.json").read_text())
        (tmp / "modules.json").write_text(json.dumps(run["modules"]))
        subprocess.run(
            [*me, "--child", "bare", "--out", str(tmp / "bare.json")]
            + ["--modules", str(tmp / "modules.json")],
            check=True,
        )
        bare = json.loads((tmp / "bare.json").read_text())
        subprocess.run(  # again with every module imported first: the phases' data alone
            [*me, "--child", "run", "--out", str(tmp / "data.json")]
            + ["--modules", str(tmp / "modules.json"), "--", *train_args[:-1], str(tmp / "r2")],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        data = json.loads((tmp / "data.json").read_text())
    for name, record in data["phases"].items():
        growth = {"end_growth": record["end_rss"] - record["start_rss"]}
        record["peak"] = record.get("peak", record["end_rss"])
        growth["peak_growth"] = record["peak"] - record["start_rss"]
        emit(
            bench="memory_ledger",
            kind="phase_modules_imported_first",
            name=name,
            **record,
            **growth,
        )
    emit(
        bench="memory_ledger",
        kind="explained_modules_imported_first",
        imports_rss_bytes=data["imports"]["rss"],
        run_vmhwm_bytes=data["whole_run_peak_of_phases"],
        over_imports_bytes=data["whole_run_peak_of_phases"] - data["imports"]["rss"],
        ledger_host_peak_bound_bytes=peak_bound(data["memory"], "host"),
        rss_before_setup_bytes=data["before_setup"],
        setup_retained_bytes=data["setup_retained"],
        predicted_bytes=data["predicted"],
        peak_over_predicted_bytes=data["whole_run_peak_of_phases"] - data["predicted"],
    )
    memory = run["memory"]
    for name, entry in memory.items():
        emit(bench="memory_ledger", kind="ledger_entry", name=name, **entry)
    phases = run["phases"]
    hwm = run["whole_run_peak_of_phases"]
    bare_hwm = bare["memory"]["peak"]
    ledger_host = peak_bound(memory, "host")
    for name, record in phases.items():
        emit(bench="memory_ledger", kind="phase", name=name, **record)
    emit(
        bench="memory_ledger",
        kind="explained",
        train_args=train_args[:-2],
        run_vmhwm_bytes=hwm,
        bare_import_vmhwm_bytes=bare_hwm,
        over_bare_bytes=hwm - bare_hwm,
        ledger_host_peak_bound_bytes=ledger_host,
        unexplained_bytes=hwm - bare_hwm - ledger_host,
        rss_before_setup_bytes=run["before_setup"],
        setup_retained_bytes=run["setup_retained"],
        predicted_bytes=run["predicted"],
        peak_over_predicted_bytes=hwm - run["predicted"],
        modules=len(run["modules"]),
        bare_import_failed=bare["failed"],
    )


if __name__ == "__main__":
    main()
