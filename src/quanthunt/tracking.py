"""Provenance in MLflow: one run per stage execution, all stages of one ``dvc repro``
under one parent run, every value scrubbed of secrets before it is written.

A run whose process died without closing it (SIGKILL, a power cut) is ended KILLED by
the next stage that starts on the same host: every run records its process
(``quanthunt.process``: host, pid and start time). A stop (Ctrl-C, or SIGTERM, which
the CLI turns into one) ends the run KILLED on the way out.

Tracking URI: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<repo root>/mlflow.db`` with
artefacts in ``<repo root>/mlruns``, where the repo root is ``$DVC_ROOT`` (set by DVC)
or the directory of the params file: never the current directory.

Usage::

    with stage_run("survey", params=params, section=params.survey, root=root) as run:
        run.log_metrics({"candidates": 5})
        run.log_artifact(Path("reports/survey/providers.csv"))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from quanthunt import __version__, interrupts
from quanthunt.errors import EXIT_INTERRUPTED, ConfigError, QuanthuntError
from quanthunt.params import section_digest
from quanthunt.redaction import redact, redact_data

PARAM_VALUE_LIMIT = 6000
"""MLflow cuts param values at 6,000 characters."""
TEXT_SUFFIXES = {".json", ".csv", ".html", ".txt", ".md", ".yaml", ".yml", ".jsonl", ".log"}
INVOCATION_TAG = "quanthunt.invocation"
PROCESS_TAG = "quanthunt.process"
"""``host:pid:start-time`` of the process that owns a run (start time in clock ticks
since boot, ``?`` where ``/proc`` is missing): tells a live owner from a dead one."""
STALE_RUN_NOTE = "its process ended without closing the run (killed); ended at the next stage start"


def repo_root(params_path: Path) -> Path:
    """``$DVC_ROOT`` when DVC runs the stage, else the directory holding the params file."""
    if dvc_root := os.environ.get("DVC_ROOT"):
        return Path(dvc_root).resolve()
    return params_path.resolve().parent


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"


def git_state(root: Path) -> tuple[str | None, bool]:
    """(commit, dirty) of the repository at ``root``; (None, False) outside git."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(  # noqa: S603 - fixed git arguments
                ["git", *args],  # noqa: S607 - git from PATH, as the user runs it
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, bool(status)


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_identity(pid: int | None = None) -> str:
    """``host:pid:start-time`` of ``pid`` (default: this process); unique across pid reuse."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or '?'}"


def process_gone(identity: str) -> bool:
    """True when ``identity`` names a process on this host that no longer runs; False when
    it still runs, runs on another host, or cannot be told."""
    try:
        host, pid_text, ticks = identity.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    if ticks != "?":
        return _start_ticks(pid) != ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


_INVOCATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")
"""An id that goes into an MLflow search filter as is."""


@dataclass(frozen=True)
class Invocation:
    """What ties the stages of one pipeline run together (see ``pipeline_invocation``)."""

    id: str
    is_dvc_process: bool
    """``id`` is the ``process_identity`` of the ``dvc`` process: when that process is gone
    the parent run is ended KILLED like a stage's."""


def pipeline_invocation() -> Invocation | None:
    """An id shared by every stage of one pipeline run: ``$QUANTHUNT_PIPELINE_ID`` (``make
    run`` sets it), else the experiment ``dvc exp run`` names in every stage's environment,
    else (Linux) the ``dvc`` process this stage runs under, read from ``/proc``, else None."""
    if explicit := os.environ.get("QUANTHUNT_PIPELINE_ID"):
        if not _INVOCATION_ID.fullmatch(explicit):
            raise ConfigError("QUANTHUNT_PIPELINE_ID: use letters, digits and . _ : - (at most 200)")
        return Invocation(explicit, is_dvc_process=False)
    if experiment := os.environ.get("DVC_EXP_NAME"):
        return Invocation(f"dvc-exp:{os.environ.get('DVC_EXP_BASELINE_REV', '')[:12]}:{experiment}", is_dvc_process=False)
    dvc = _dvc_process()
    return Invocation(dvc, is_dvc_process=True) if dvc is not None else None


def _dvc_process() -> str | None:
    """The ``process_identity`` of the ``dvc`` process above this one, from ``/proc``."""
    pid = os.getppid()
    for _ in range(12):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        words = [Path(a.decode(errors="replace")).name for a in argv if a]
        if "dvc" in words or any(w == "dvc" for w in words[1:3]):
            return f"{socket.gethostname()}:{pid}:{stat[19]}"
        pid = int(stat[1])
        if pid <= 1:
            return None
    return None


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"policy": {"min_uptime": 90}}`` → ``{"policy.min_uptime": 90}``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def file_digest(path: Path) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            md5.update(chunk)
    return md5.hexdigest()


class StageRun:
    """One MLflow run; every call redacts what it writes."""

    def __init__(self, client: Any, run_id: str, root: Path) -> None:
        self.client = client
        self.run_id = run_id
        self.root = root
        self.children: list[StageRun] = []

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, redact(str(value))[:PARAM_VALUE_LIMIT])

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(redact_data(dict(params)))
        entries = [Param(k, json.dumps(v) if isinstance(v, list | dict) else str(v)) for k, v in flat.items()]
        for start in range(0, len(entries), 100):
            chunk = entries[start : start + 100]
            self.client.log_batch(self.run_id, params=[Param(p.key, p.value[:PARAM_VALUE_LIMIT]) for p in chunk])

    def log_metrics(self, metrics: Mapping[str, float | int]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, 0) for k, v in metrics.items() if v is not None]
        for start in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 500])

    def log_series(self, key: str, points: Sequence[tuple[int, float]]) -> None:
        """One metric over steps (e.g. a monitor's e-value after each monitored reply)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(v), now, int(step)) for step, v in points]
        for start in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 500])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Log a file; text files are redacted on the way."""
        if path.suffix.lower() not in TEXT_SUFFIXES:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
            return
        with tempfile.TemporaryDirectory() as tmp:
            clean = Path(tmp) / path.name
            clean.write_text(redact(path.read_text(encoding="utf-8", errors="replace")), encoding="utf-8")
            self.client.log_artifact(self.run_id, str(clean), artifact_path)

    def log_dict(self, data: Mapping[str, Any], name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / name
            target.write_text(json.dumps(redact_data(dict(data)), indent=2, sort_keys=True, default=str), encoding="utf-8")
            self.client.log_artifact(self.run_id, str(target))

    def child(self, name: str, tags: Mapping[str, str] | None = None) -> StageRun:
        """A nested run (e.g. one per provider), finished when the parent's context ends."""
        run = self.client.get_run(self.run_id)
        created = self.client.create_run(
            run.info.experiment_id,
            tags={
                **{k: redact(v) for k, v in (tags or {}).items()},
                "mlflow.parentRunId": self.run_id,
                PROCESS_TAG: process_identity(),
            },
            run_name=name,
        )
        child = StageRun(self.client, str(created.info.run_id), self.root)
        self.children.append(child)
        return child

    def log_input(self, path: Path, *, context: str = "input", tags: Mapping[str, str] | None = None) -> str:
        """Log a file as a dataset input (name, source, md5 digest); returns the digest."""
        return self._log_dataset(path, context=context, tags=tags)

    def log_output(self, path: Path, *, tags: Mapping[str, str] | None = None) -> str:
        """Log a produced file as a dataset with context ``output``."""
        return self._log_dataset(path, context="output", tags=tags)

    def _log_dataset(self, path: Path, *, context: str, tags: Mapping[str, str] | None) -> str:
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        digest = file_digest(path)
        try:
            name = str(path.resolve().relative_to(self.root))
        except ValueError:
            name = path.name
        with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local files
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(str(path.resolve()))
        dataset = MetaDataset(source, name=name, digest=digest[:36])  # type: ignore[abstract]
        input_tags = [InputTag("mlflow.data.context", context)] + [InputTag(k, redact(v)) for k, v in (tags or {}).items()]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=input_tags)])
        return digest


def _client(root: Path) -> Any:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # not "Creating initial MLflow database tables"
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri(root))


def _experiment_id(client: Any, name: str, root: Path) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=(root / "mlruns").resolve().as_uri()))
    except Exception:  # created meanwhile by another stage
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


def _parent_run(client: Any, experiment_id: str, invocation: Invocation, tags: Mapping[str, str]) -> str:
    found = client.search_runs([experiment_id], filter_string=f"tags.`{INVOCATION_TAG}` = '{invocation.id}'", max_results=1)
    if found:
        run_id = str(found[0].info.run_id)
        client.update_run(run_id, status="RUNNING")
        return run_id
    name = "pipeline " + datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
    parent_tags = {**tags, INVOCATION_TAG: invocation.id, "quanthunt.kind": "pipeline"}
    if invocation.is_dvc_process:
        parent_tags[PROCESS_TAG] = invocation.id
    run = client.create_run(experiment_id, tags=parent_tags, run_name=name)
    return str(run.info.run_id)


def end_stale_runs(client: Any, experiment_id: str) -> list[str]:
    """End KILLED every RUNNING run whose owning process (``quanthunt.process``) on this
    host is gone; returns their ids. Runs of live processes and other hosts are left alone."""
    running = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
    ended = []
    for found in running:
        owner = found.data.tags.get(PROCESS_TAG)
        if owner and process_gone(owner):
            run_id = str(found.info.run_id)
            with contextlib.suppress(Exception):
                if "quanthunt.error" not in found.data.tags:
                    client.set_tag(run_id, "quanthunt.error", STALE_RUN_NOTE)
            client.set_terminated(run_id, status="KILLED")
            ended.append(run_id)
    return ended


STOPPED = "stopped by Ctrl-C or SIGTERM"
"""The error tag of a stage run ended KILLED by a stop signal."""


def ended_status(exc: BaseException) -> str:
    """MLflow's end status for a stage stopped by ``exc``: KILLED for a stop (Ctrl-C,
    SIGTERM: ``KeyboardInterrupt``, or ``EXIT_INTERRUPTED``, e.g. a graceful stop's own
    error), FAILED for anything else."""
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED"
    code = exc.code if isinstance(exc, SystemExit) else getattr(exc, "exit_code", None)
    return "KILLED" if code == EXIT_INTERRUPTED else "FAILED"


@contextlib.contextmanager
def stage_run(stage: str, *, params: BaseModel, section: BaseModel, root: Path, experiment: str) -> Iterator[StageRun]:
    """An MLflow run for one stage execution, nested under the pipeline's parent run.

    First ends KILLED the runs of processes that died without closing them. On an
    exception the run ends FAILED with the (redacted) error as a tag, or KILLED for a stop
    (see ``ended_status``).
    """
    client = _client(root)
    experiment_id = _experiment_id(client, experiment, root)
    end_stale_runs(client, experiment_id)
    commit, dirty = git_state(root)
    tags: dict[str, str] = {
        "git.commit": commit or "none",
        "git.dirty": str(dirty).lower(),
        "quanthunt.version": __version__,
    }
    if exp_name := os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = exp_name
    section_json = section.model_dump(mode="json")
    run_tags = {
        **tags,
        "dvc.stage": os.environ.get("DVC_STAGE") or stage,
        "quanthunt.stage": stage,
        "quanthunt.params_sha256": section_digest(section),
        PROCESS_TAG: process_identity(),
    }
    parent_id = None
    if invocation := pipeline_invocation():
        parent_id = _parent_run(client, experiment_id, invocation, tags)
        run_tags["mlflow.parentRunId"] = parent_id
    run_name = os.environ.get("DVC_STAGE") or stage
    created = client.create_run(experiment_id, tags={k: redact(v) for k, v in run_tags.items()}, run_name=run_name)
    run = StageRun(client, str(created.info.run_id), root)
    status = "FAILED"
    try:
        run.log_params(section_json)
        run.log_dict(params.model_dump(mode="json"), "params.resolved.json")
        yield run
        status = "FINISHED"
        if interrupts.received():  # its KeyboardInterrupt was dropped (raised in a finaliser)
            status = "KILLED"  # and the stage ran on to its end; it was stopped all the same
            with contextlib.suppress(Exception):
                run.set_tags({"quanthunt.error": STOPPED})
    except BaseException as exc:
        status = ended_status(exc)
        if isinstance(exc, QuanthuntError):
            message = str(exc)
        elif status == "KILLED":
            message = STOPPED
        else:
            message = f"{exc.__class__.__name__}: {exc}"
        with contextlib.suppress(Exception):
            run.set_tags({"quanthunt.error": message[:1000]})
        raise
    finally:
        for child in run.children:
            client.set_terminated(child.run_id, status=status)
        client.set_terminated(run.run_id, status=status)
        if parent_id:
            client.set_terminated(parent_id, status=status)


def latest_stage(root: Path, experiment: str) -> str | None:
    """The stage of the newest stage run, or None when nothing ran yet."""
    client = _client(root)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    order = ["attributes.start_time DESC"]
    runs = client.search_runs([found.experiment_id], filter_string="tags.`quanthunt.stage` != ''", order_by=order, max_results=1)
    return str(runs[0].data.tags["quanthunt.stage"]) if runs else None


def _quoted(value: str) -> str:
    """``value`` as a literal in an MLflow filter string."""
    if "'" in value:
        raise QuanthuntError(f"{value!r}: a stage or dataset name has no quotes")
    return f"'{value}'"


def search_stage_runs(
    root: Path, experiment: str, *, stage: str | None, last: int, dataset: str | None = None
) -> list[dict[str, Any]]:
    """The newest ``last`` stage runs (optionally of one stage and one dataset), as plain dicts."""
    client = _client(root)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    query = "tags.`quanthunt.stage` != ''" if stage is None else f"tags.`quanthunt.stage` = {_quoted(stage)}"
    if dataset is not None:
        query += f" and tags.`dataset` = {_quoted(dataset)}"
    order = ["attributes.start_time DESC"]
    runs = client.search_runs([found.experiment_id], filter_string=query, order_by=order, max_results=last)
    return [
        {
            "run_id": r.info.run_id,
            "stage": r.data.tags.get("quanthunt.stage", ""),
            "dataset": r.data.tags.get("dataset", ""),
            "status": r.info.status,
            "started": datetime.fromtimestamp(r.info.start_time / 1000, UTC).isoformat(timespec="seconds"),
            "parent": r.data.tags.get("mlflow.parentRunId", ""),
            "params": dict(r.data.params),
            "metrics": dict(r.data.metrics),
            "tags": {k: v for k, v in r.data.tags.items() if not k.startswith("mlflow.")},
        }
        for r in runs
    ]
