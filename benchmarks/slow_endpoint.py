"""Does one slow, queueing endpoint slow the others' probes in an audit? (issue 27)

Usage: ``.venv/bin/python benchmarks/slow_endpoint.py [--trials 7]``

A latency-mode sandbox serves two fast endpoints (0.5 s a reply) and one that serves 4
requests at a time at 0.8 s, so its second wave times out (``tests/fixtures/congestion.py``).
Each trial audits one round of 16 probes at the fast endpoints alone, then at all three
together, as ``audit_all`` does (one auditor, one gateway client, a limit per endpoint).
Prints each fast endpoint's finishing times, alone and together: the medians, their ratio,
and the median of the trials' paired ratios; the goal is together within 20 % of alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures, as pipeline_bed does

from fixtures.congestion import FAST, FAST_PROVIDERS, QUEUEING, finishing_times
from fixtures.sandbox import roster_dict

from quanthunt.sandbox.server import SandboxProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        roster = Path(tmp) / "roster.yaml"
        roster.write_text(yaml.safe_dump(roster_dict(QUEUEING, *FAST_PROVIDERS)), encoding="utf-8")
        with SandboxProcess(mode="latency", roster=roster, log_path=Path(tmp) / "sandbox.log") as sandbox:
            finishing_times(sandbox, FAST)  # warm
            alone: list[dict[str, float]] = []
            together: list[dict[str, float]] = []
            timeouts = cuts = 0
            for trial in range(args.trials):
                alone.append(finishing_times(sandbox, FAST)[0])
                times, audits, auditor = finishing_times(sandbox, ("slow", *FAST))
                together.append(times)
                timeouts += audits["slow"].errors["timeout"]
                cuts += sum(auditor.limits[f"{slug}/int4"].cuts for slug in FAST)
                print(f"trial {trial + 1}: alone {fmt(alone[-1])}; with the queueing endpoint {fmt(times)}", flush=True)
    summary = f"the queueing endpoint timed out {timeouts} times, the fast ones' limits were cut {cuts} times"
    print(f"\n{args.trials} trials: {summary}")
    print("| endpoint | alone, median s | together, median s | ratio of medians | median paired ratio | within 20 % |")
    print("|---|---|---|---|---|---|")
    for slug in FAST:
        a = statistics.median(t[slug] for t in alone)
        b = statistics.median(t[slug] for t in together)
        paired = statistics.median(t[slug] / s[slug] for s, t in zip(alone, together, strict=True))
        print(f"| {slug} | {a:.2f} | {b:.2f} | {b / a:.2f} | {paired:.2f} | {'yes' if abs(paired - 1) <= 0.2 else 'no'} |")


def fmt(times: dict[str, float]) -> str:
    return ", ".join(f"{slug} {seconds:.2f} s" for slug, seconds in times.items())


if __name__ == "__main__":
    main()
