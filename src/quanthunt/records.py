"""A generated record's line and the dataset's output file.

``record_line`` renders a finished record (the conversation with its regenerated turns,
and per-turn provenance). ``RecordSink`` appends lines in groups behind the ledger (the
ledger commits a record's replies before its line reaches the file, and marks it done
with the line's sha256 after); ``prepare_output`` repairs the file against the ledger at
each start; ``publish`` copies a finished working file over the DVC output atomically.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from quanthunt import __version__
from quanthunt.errors import ConfigError
from quanthunt.jobs import Eligible, Job
from quanthunt.ledger import BILLING, Ledger, LedgerWriter, WriteRecords, resolve_batch
from quanthunt.prompts import PromptRecord, skeleton

TURN_FIELDS = ("generation_id", "finish_reason", "prompt_tokens", "completion_tokens", "cost_usd", "monitor")
"""What a turn's provenance copies from its reply."""


def record_line(
    job: Job,
    record: PromptRecord,
    replies: Sequence[Mapping[str, Any]],
    *,
    endpoints: Mapping[str, Eligible],
    cost_usd: float,
    attempts: Sequence[Counter[str]],
    started: float,
) -> str:
    """A finished record's line: the conversation with its regenerated assistant turns
    (with ``reasoning_content`` where the model reasoned), and its provenance: each turn's
    endpoint, verdict, reply fields and every attempt by billing; the record's providers in
    order of first use, sampling, usage and cost (``cost_usd``: all its attempts, earlier
    runs' too)."""
    conversation: list[dict[str, Any]] = []
    segments = skeleton(record)
    for segment, reply in zip(segments, replies, strict=True):
        conversation += [{"role": t.role, "content": t.content} for t in segment]
        turn: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if reply.get("reasoning"):
            turn["reasoning_content"] = reply["reasoning"]
        conversation.append(turn)
    turns = [
        {
            **_served_by(r, endpoints),
            "verification_run_id": job.verification_run_id,
            **{k: r.get(k) for k in TURN_FIELDS},
            # Every attempt of every run, not only the one that succeeded.
            "attempts": a.total(),
            "attempts_by_billing": {b: a[b] for b in BILLING},
        }
        for r, a in zip(replies, attempts, strict=True)
    ]
    served_by = {r["endpoint_tag"]: _served_by(r, endpoints) for r in replies}
    provenance = {
        "providers": list(served_by.values()),  # in order of first use; each turn names its own
        "verification_run_id": job.verification_run_id,
        "model": job.model,
        "sampling": {
            "temperature": job.sampling.temperature,
            "top_p": job.sampling.top_p,
            "max_tokens": job.sampling.max_tokens,
            "seed": job.sampling.seed,
        },
        "usage": {
            "prompt_tokens": sum(r["prompt_tokens"] for r in replies),
            "completion_tokens": sum(r["completion_tokens"] for r in replies),
            "cost_usd": round(cost_usd, 10),
        },
        "attempts": sum(a.total() for a in attempts),
        "turns": turns,
        "started_at": _iso(started),
        "finished_at": _iso(time.time()),
        "params_sha256": job.params_hash,
        "quanthunt_version": __version__,
    }
    return orjson.dumps(
        {"id": record.id, "dataset": job.dataset, "conversations": conversation, "provenance": provenance}
    ).decode()


def _served_by(reply: Mapping[str, Any], endpoints: Mapping[str, Eligible]) -> dict[str, str | None]:
    """The endpoint's provenance; a turn an earlier run got from an endpoint this run's
    verdicts no longer list keeps its name, and validation will refuse it."""
    endpoint = endpoints.get(str(reply["endpoint_tag"]))
    if endpoint is not None:
        return endpoint.provenance()
    return {"provider": reply.get("provider"), "endpoint_tag": reply["endpoint_tag"], "declared_quantization": None,
            "verdict": None, "verdict_run_id": None}  # fmt: skip


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds")


def sha256_line(line: str) -> str:
    return hashlib.sha256(line.encode()).hexdigest()


class RecordSink:
    """Appends finished records to the output in groups: wait for the ledger to commit the
    records' finished turns, write, flush, fsync, then mark them done in the ledger (with
    each line's sha256). A crash in between is repaired at the next start by
    ``prepare_output``. Workers hand a record over with ``add`` and go on with the next one;
    the returned future says when it is safely written."""

    def __init__(self, path: Path, writer: LedgerWriter, dataset: str, params_hash: str, *, interval_s: float = 0.01) -> None:
        self.path, self.writer = path, writer
        self.dataset, self.params_hash, self.interval_s = dataset, params_hash, interval_s
        self._pending: list[tuple[str, str, tuple[asyncio.Future[Any], ...], asyncio.Future[None]]] = []
        self._outstanding: set[asyncio.Future[None]] = set()
        self._wakeup = asyncio.Event()
        self._closed = False
        self._error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._fh = path.open("ab")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def backlog(self) -> int:
        """Records handed over and not yet written."""
        return len(self._outstanding)

    def add(self, record_id: str, line: str, *, after: Iterable[asyncio.Future[Any]] = ()) -> asyncio.Future[None]:
        """Queue a finished record. ``after``: the ledger writes of its finished turns, which
        must commit before its line reaches the file (so no line exists whose cost the
        ledger does not know). The future resolves once the line is fsynced and marked done."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
            return future
        self._pending.append((record_id, line, tuple(after), future))
        self._outstanding.add(future)
        future.add_done_callback(self._outstanding.discard)
        self._wakeup.set()
        return future

    def finished(self, record_id: str, state: str) -> None:
        """A record ended without a line: nothing to note, the next run tries it again."""

    async def drain(self) -> None:
        """Wait until every record handed over is written (or failed)."""
        if self._outstanding:
            await asyncio.gather(*self._outstanding, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._closed:
                await asyncio.sleep(self.interval_s)
            batch, self._pending = self._pending, []
            if batch:
                await self._flush(batch)
            if self._closed and not self._pending:
                return

    async def _flush(self, batch: list[tuple[str, str, tuple[asyncio.Future[Any], ...], asyncio.Future[None]]]) -> None:
        try:
            if self._error is not None:
                raise self._error
            await asyncio.gather(*(f for _, _, after, _ in batch for f in after))
            self._fh.write(b"".join((line + "\n").encode() for _, line, _, _ in batch))
            self._fh.flush()
            os.fsync(self._fh.fileno())
            lines = [(record_id, line, sha256_line(line)) for record_id, line, _, _ in batch]
            await self.writer.write(WriteRecords(self.dataset, self.params_hash, lines))
        except Exception as exc:  # every record of the batch, and every later one, fails with it
            self._error = exc
            resolve_batch([future for *_, future in batch], error=exc)
            return
        resolve_batch([future for *_, future in batch])

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        self._fh.close()


@dataclass(frozen=True)
class Repair:
    """What ``prepare_output`` found and fixed before a run."""

    done_ids: frozenset[str]
    truncated_bytes: int
    adopted: int
    """Lines already in the file that the ledger had not marked done (a crash between)."""
    restored: int
    """Records the ledger marked done that were missing from the file, written back from
    the ledger's copy of the line."""
    edited: tuple[str, ...]
    """Ids whose line differs from the one the ledger recorded (validation will name them)."""


def prepare_output(path: Path, ledger: Ledger, dataset: str, params_hash: str) -> Repair:
    """Make the output file and the ledger agree before generating (called under the
    dataset's lock): cut a half-written last line, adopt lines the ledger missed, write back
    done records the file lost. Refuses (``ConfigError``) to mix records made with other
    sampling params, or a file with an id twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.read_bytes() if path.exists() else b""
    truncated = 0
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        truncated = len(data) - keep
        with path.open("r+b") as fh:
            fh.truncate(keep)
        data = data[:keep]
    in_file: dict[str, str] = {}
    for number, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            entry = json.loads(raw)
            record_id, record_hash = str(entry["id"]), entry["provenance"]["params_sha256"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path}:{number}: not a generated record; move the file away to start over") from None
        if record_hash != params_hash:
            raise ConfigError(
                f"{path}:{number}: record {record_id} was generated with other sampling params ({record_hash[:12]}); "
                "move the file away or restore those params"
            )
        if record_id in in_file:
            raise ConfigError(f"{path}:{number}: record {record_id} appears twice")
        in_file[record_id] = raw
    recorded = ledger.done_records(dataset, params_hash)
    adopt = [(r, line) for r, line in in_file.items() if r not in recorded]
    restore = [(r, line) for r, (_, line) in recorded.items() if r not in in_file]
    edited = tuple(sorted(r for r, line in in_file.items() if r in recorded and sha256_line(line) != recorded[r][0]))
    if adopt:
        ledger.write(WriteRecords(dataset, params_hash, [(r, line, sha256_line(line)) for r, line in adopt]))
    if restore:
        with path.open("ab") as fh:
            fh.write(b"".join((line + "\n").encode() for _, line in restore))
            fh.flush()
            os.fsync(fh.fileno())
    return Repair(frozenset(in_file) | {r for r, _ in restore}, truncated, len(adopt), len(restore), edited)


def adopt_published(published: Path, working: Path, params_hash: str) -> None:
    """Start ``working`` from the published file when it holds these params' records (a
    project generated before working files existed keeps its bytes, so DVC reruns nothing)."""
    if working.exists() or not published.exists():
        return
    with published.open("rb") as fh:
        first = fh.readline()
    try:
        same = json.loads(first)["provenance"]["params_sha256"] == params_hash
    except (ValueError, KeyError, TypeError):
        return
    if same:
        _copy_atomic(published, working)


def publish(working: Path, published: Path) -> None:
    """Copy a finished working file over the published output (the DVC output), atomically:
    the published file only ever holds a whole run's records."""
    _copy_atomic(working, published)


def _copy_atomic(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with source.open("rb") as src, staged.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(staged, target)
