"""The generate stage's monitor end to end, over seeded runs: the real model in the sandbox,
three verified providers, one of which drifts to NVFP4 after 30 % of its share of a dataset.

Each run is a fresh project and a fresh sandbox (the drift counts the endpoint's requests
since the sandbox started) with its own roster seed and sampling seed: ``quanthunt survey``,
verdicts written for the three providers (the verify stage is measured in
``verify_power.py``; here every provider is taken as verified, with no audit to continue),
``quanthunt generate`` with every reply monitored (``generate.monitor.share: 1``: a
60-record dataset gives the drifted provider ~14 monitored replies after its drift; at the
default share of 0.05 the same number takes ~20x the requests; 32-token answers, 8 requests in
flight), then ``quanthunt validate``.

Per run it reads the sandbox's hidden truth (which generation ids were served drifted) and
reports: where the drifted provider's monitor stopped it (in its monitored replies, against
the drift), how many replies it served before routing stopped, whether any drifted record
reached ``data/final``, how many records were quarantined, and whether a faithful provider
was ever stopped.

Usage: ``.venv/bin/python benchmarks/monitor_end_to_end.py --runs 20`` (~1.5 minutes a run
on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from quanthunt.prompts import iter_prompts
from quanthunt.sandbox.server import SandboxProcess
from quanthunt.verdicts import ProviderVerdict, Verdicts

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SANDBOX_KEY = "sk-quanthunt-sandbox"
DATASETS = ("chat", "code")
"""Single-turn records of the shipped datasets, 60 together, as one dataset."""
MAX_TOKENS = 32
MAX_UNSCORED = 2
"""The sandbox's reference shares the 2 cores with generation and falls behind it; with the
default 8 the drifted provider's whole share of this short dataset is served before its
scores come (the bound is what it may serve unvetted: delay + max_unscored + in flight)."""
SHARE_BEFORE_DRIFT = 0.3


def provider(slug: str, precision: str, **extra: Any) -> dict[str, Any]:
    return {"name": slug.capitalize(), "slug": slug, "tag": f"{slug}/int4", "quantization": "int4", "precision": precision,
            "pricing": {"prompt": "0.000001", "completion": "0.000002"}, "latency_ms": 0, "throughput_tps": 100_000,
            **extra}  # fmt: skip


def verdict(entry: dict[str, Any]) -> ProviderVerdict:
    return ProviderVerdict(
        provider=entry["name"], tag=entry["tag"], declared_quantization="int4", survey_decision="candidate", eligible=True,
        mode="logprob", verdict="equivalent", reason="taken as verified (benchmark)", tests=[], effects={}, power={},
        probes_needed=None, probes=0, completions=0, failed_requests=0, errors={}, tokens=0, served_by={}, cost_usd=0.0,
    )  # fmt: skip


def prompts(target: Path) -> int:
    lines = []
    for name in DATASETS:
        for record in iter_prompts(ROOT / "data/prompts" / f"{name}.jsonl"):
            turns = [{"role": t.role, "content": t.content} for t in record.conversations if t.role != "assistant"]
            if sum(t["role"] == "user" for t in turns) == 1:
                lines.append(json.dumps({"id": record.id, "messages": turns}))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def run_once(seed: int, work: Path) -> dict[str, Any]:
    project = work / f"run-{seed}"
    project.mkdir()
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, project / name)
    records = prompts(project / "data/prompts/mix.jsonl")
    drift_after = round(SHARE_BEFORE_DRIFT * records / 3)
    roster = {
        "seed": seed,
        "providers": [
            provider("alpha", "int4-bf16act"),
            provider("beta", "int4-native", drift=[{"after_requests": drift_after, "precision": "nvfp4"}]),
            provider("gamma", "int4-native"),
        ],
        "credits": {"default_usd": 100.0},
    }
    (project / "roster.yaml").write_text(yaml.safe_dump(roster), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "MLFLOW_TRACKING_URI", "DVC_ROOT")}
    env |= {"DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    with SandboxProcess(mode="model", roster=project / "roster.yaml", log_path=project / "sandbox.log") as sandbox:
        params = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
        params["api"]["base_url"] = sandbox.api_url
        params["reference"]["base_url"] = sandbox.reference_url
        params["datasets"] = ["mix"]
        g = params["generate"]
        g["max_records"] = None
        g["concurrency"] = 8
        g["sampling"]["seed"] = seed
        g["sampling"]["max_tokens"] = MAX_TOKENS
        g["monitor"]["share"] = 1.0
        g["monitor"]["max_unscored"] = MAX_UNSCORED
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")

        def quanthunt(*args: str) -> subprocess.CompletedProcess[str]:
            cmd = [str(BIN / "quanthunt"), *args, "--params", "params.yaml"]
            return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=1800, check=False)

        for step in (("survey",),):
            done = quanthunt(*step)
            if done.returncode:
                raise SystemExit(f"run {seed}: quanthunt {step[0]} failed: {done.stderr[-2000:]}")
        verdicts = Verdicts(model=params["survey"]["model"], reference_model=params["survey"]["model"],
                            created_at="2026-12-03T00:00:00+00:00", params_sha256="0" * 64, alpha=0.05, correction="holm",
                            probe_ids=[], verification_run_id=f"benchmark-{seed}", cost_usd=0.0,
                            providers=[verdict(p) for p in roster["providers"]])  # fmt: skip
        (project / "reports/verify").mkdir(parents=True, exist_ok=True)
        (project / "reports/verify/verdicts.json").write_text(verdicts.model_dump_json(indent=2), encoding="utf-8")
        started = time.monotonic()
        generated = quanthunt("generate", "mix")
        elapsed = time.monotonic() - started
        validated = quanthunt("validate", "mix")
        stats = httpx.get(f"{sandbox.api_url}/sandbox/stats", headers={"Authorization": f"Bearer {SANDBOX_KEY}"}).json()
    summary = json.loads((project / "reports/generate/mix.json").read_text(encoding="utf-8"))
    final_path = project / "data/final/mix.jsonl"
    final = [json.loads(line) for line in final_path.read_text(encoding="utf-8").splitlines()] if final_path.exists() else []
    drifted = set(stats["drifted_generations"].get("beta/int4", []))
    exported = {t["generation_id"] for r in final for t in r["provenance"]["turns"]}
    monitors = summary["monitor"]["providers"]
    stop = monitors["beta/int4"]["stopped"]
    card = json.loads((project / "data/final/mix.card.json").read_text(encoding="utf-8")) if final else {}
    return {
        "seed": seed,
        "exit": (generated.returncode, validated.returncode),
        "records": records,
        "drift_after": drift_after,
        "stop_at": None if stop is None else stop["at"],
        "suspect_from": None if stop is None else stop["suspect_from"] * params["generate"]["monitor"]["checkpoint_every"],
        "beta_replies": monitors["beta/int4"]["replies"],
        "beta_before_stop": summary["monitor_stops"].get("beta/int4", {}).get("replies_before"),
        "faithful_stopped": [t for t in ("alpha/int4", "gamma/int4") if monitors[t]["stopped"] is not None],
        "drifted": len(drifted),
        "drifted_exported": len(drifted & exported),
        "quarantined": card.get("quarantined", {}).get("records"),
        "exported": len(final),
        "seconds": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here (default: a temp dir)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="monitor-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print("seed  exit    drift@  stop@  quarantine from  beta replies (before routing stopped)  drifted / exported  "
          "quarantined  exported  faithful stopped  generate s")  # fmt: skip
    for seed in range(args.first_seed, args.first_seed + args.runs):
        row = run_once(seed, work)
        rows.append(row)
        print(f"{row['seed']:>4}  {row['exit']!s:<7} {row['drift_after']:>6}  {row['stop_at']!s:>5}  "
              f"{row['suspect_from']!s:>15}  {row['beta_replies']:>5} ({row['beta_before_stop']!s:>4}){'':>24}"
              f"{row['drifted']:>4} / {row['drifted_exported']:<4}  {row['quarantined']!s:>11}  {row['exported']:>8}  "
              f"{','.join(row['faithful_stopped']) or 'none':>16}  {row['seconds']:>10}", flush=True)  # fmt: skip
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    early = [r["seed"] for r in rows if r["stop_at"] is not None and r["stop_at"] < r["drift_after"]]
    stopped = [r for r in rows if r["stop_at"] is not None and r["seed"] not in early]
    delays = [r["stop_at"] - r["drift_after"] + 1 for r in stopped]
    lags = [r["beta_replies"] - r["stop_at"] - 1 for r in stopped]
    print()
    print(
        f"runs {len(rows)}; drifted provider stopped after its drift in {len(stopped)}; monitored replies, drift to stop "
        f"(the drifted one included): median {statistics.median(delays) if delays else '-'}, max {max(delays, default='-')}"
    )
    print(
        f"drifted records exported: {sum(r['drifted_exported'] for r in rows)} (of {sum(r['drifted'] for r in rows)} "
        f"drifted replies); faithful providers stopped: {sum(len(r['faithful_stopped']) for r in rows)} of {2 * len(rows)}"
    )
    print(
        f"replies the drifted provider served after the stop (in flight, or sent while its last monitored replies "
        f"waited to be scored): median {statistics.median(lags) if lags else '-'}, max {max(lags, default='-')}"
    )
    print(f"drifting provider stopped before its drift (a false stop: it was faithful then): runs {early}")
    print(f"runs not exiting 0/0: {[r['seed'] for r in rows if r['exit'] != (0, 0)]}")


if __name__ == "__main__":
    main()
