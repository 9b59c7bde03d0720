"""One JSON line summing up a pytest JUnit XML report, with the machine it ran on (run.sh).

python bench/gpu/junit_summary.py REPORT.xml --name cuda-tests --rc 0
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from compare import machine


def summarise(report: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, skip_reasons = [], {}
    if not report.exists():
        return {**counts, "report": "missing (pytest did not finish: see the log)"}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next(
            (child for child in case if child.tag in ("failure", "error", "skipped")), None
        )
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = (outcome.get("message") or "")[:200]
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failed.append({"test": name, "message": (outcome.get("message") or "")[:300]})
    return {**counts, "failures": failed, "skip_reasons": skip_reasons}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--rc", type=int, required=True, help="pytest's exit status")
    args = parser.parse_args()
    line = {
        "bench": "gpu-tests",
        "name": args.name,
        "pytest_exit_status": args.rc,
        **summarise(args.report),
        "machine": machine(),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
