"""A throwaway project for the reliability benchmarks: a copy of the pipeline in a temp
folder, pointed at a latency-mode sandbox with a roster of the benchmark's own, with
survey output and verdicts in place (the same set-up the generate tests use)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.generation import write_prompts, write_verdicts  # noqa: E402

from quanthunt.sandbox.server import SandboxProcess  # noqa: E402

BIN = Path(sys.executable).parent
KEY = "sk-quanthunt-sandbox"


@dataclass
class Bed:
    root: Path
    sandbox: SandboxProcess
    env: dict[str, str]

    def set_param(self, dotted: str, value: Any) -> None:
        path = self.root / "params.yaml"
        data = yaml.safe_load(path.read_text())
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
        path.write_text(yaml.safe_dump(data, sort_keys=False))

    def command(self, *args: str) -> list[str]:
        return [str(BIN / "quanthunt"), *args, "--params", "params.yaml"]

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.command(*args), cwd=self.root, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), cwd=self.root, env=self.env, capture_output=True, text=True, check=False)

    def add_dataset(self, name: str, records: int) -> None:
        write_prompts(self.root / "data/prompts" / f"{name}.jsonl", records)
        datasets = yaml.safe_load((self.root / "params.yaml").read_text())["datasets"]
        self.set_param("datasets", [*datasets, name] if name not in datasets else datasets)

    def records(self, dataset: str) -> list[str]:
        path = self.root / "data/generated" / f"{dataset}.jsonl"
        return [json.loads(line)["id"] for line in path.read_text().splitlines()] if path.exists() else []

    def ledger(self) -> sqlite3.Connection:
        return sqlite3.connect(self.root / "state/ledger.sqlite")

    def sandbox_stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.sandbox.api_url}/sandbox/stats", headers={"Authorization": f"Bearer {KEY}"}).json())


def make_bed(roster: dict[str, Any], *, settings: dict[str, Any]) -> Bed:
    root = Path(tempfile.mkdtemp(prefix="qh-bed-"))
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, root / name)
    (root / "roster.yaml").write_text(yaml.safe_dump(roster))
    sandbox = SandboxProcess(mode="latency", roster=root / "roster.yaml", log_path=root / "sandbox.log").start()
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "MLFLOW_TRACKING_URI", "DVC_ROOT")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", MLFLOW_DISABLE_TELEMETRY="true")
    bed = Bed(root, sandbox, env)
    bed.set_param("api.base_url", sandbox.api_url)
    bed.set_param("reference.base_url", sandbox.reference_url)
    bed.set_param("datasets", ["warmup"])
    write_prompts(root / "data/prompts/warmup.jsonl", 1)
    for key, value in settings.items():
        bed.set_param(key, value)
    survey = bed.run("survey")
    if survey.returncode != 0:
        raise SystemExit(f"survey failed: {survey.stderr}")
    model = yaml.safe_load((root / "params.yaml").read_text())["survey"]["model"]
    write_verdicts(root, list(roster["providers"]), model)
    return bed
