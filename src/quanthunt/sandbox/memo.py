"""What the model sandbox computed, kept in a SQLite file so that a later sandbox process
answers the very same request without computing it again (``$QUANTHUNT_SANDBOX_MEMO``).

Every request the sandbox's model answers is seeded (``SamplingRequest.seed``; the gateway
draws one for an unseeded chat), so a sample is a function of the precision and the request,
and a teacher-forced score of the precision and the token ids: what the memo keeps is what
computing again would give, but for batching, which may flip a sampled token at a near-tie
(``tests/sandbox/test_sampler.py``). The test suite sets it: its stage tests run the same
audits of the same prompts again and again, each in a new sandbox process (2026-12-06, slow
EPYC, with in-flight sharing: its tests' durations summed 3,310 s against 4,086 s without).
A user may set it too, for repeated sandbox experiments.

A row is keyed by a digest of the model's file, of the sandbox modules that make the
numbers (a code change never reads an older row), the kind, the precision and the request,
so a hit is the request's own answer; rows are only added. Written in WAL mode, so the
test workers' sandboxes share one file, and a sandbox killed mid-write loses only its row.

Usage: ``memo = Memo.from_environment(model_digest=d); sample = memo.answer("sample", "nvfp4", request)``
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from quanthunt.errors import SandboxError
from quanthunt.sandbox.sampler import Sample, TokenLogprob

VARIABLE = "QUANTHUNT_SANDBOX_MEMO"
NUMERIC_MODULES = ("decoder.py", "engine.py", "formats.py", "model.py", "model_engine.py", "sampler.py")
"""The sandbox modules whose code decides what a request's answer is (their bytes key the memo)."""
_SCHEMA = "CREATE TABLE IF NOT EXISTS answers (key BLOB PRIMARY KEY, answer BLOB NOT NULL) WITHOUT ROWID"
BUSY_TIMEOUT_MS = 60_000
"""How long a write waits for another process's (both test workers' sandboxes write at once)."""


def code_digest() -> str:
    """sha256 of the sandbox's numeric modules, as installed."""
    here = Path(__file__).parent
    sha = hashlib.sha256()
    for name in NUMERIC_MODULES:
        sha.update(name.encode() + b"\0" + (here / name).read_bytes())
    return sha.hexdigest()


def _token(t: TokenLogprob) -> list[Any]:
    return [t.token_id, t.logprob, [[i, lp] for i, lp in t.top]]


def _untoken(raw: list[Any]) -> TokenLogprob:
    return TokenLogprob(int(raw[0]), float(raw[1]), [(int(i), float(lp)) for i, lp in raw[2]])


class Memo:
    """The answers of one model (``model_digest``) by this code, in the SQLite file ``path``."""

    def __init__(self, path: Path, *, model_digest: str) -> None:
        self.path = path
        self._namespace = f"{model_digest}:{code_digest()}"
        self._lock = threading.Lock()
        self.hits = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False, isolation_level=None)
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")  # a cache: a power cut may lose the last rows, never corrupt
            self._db.execute(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise SandboxError(f"${VARIABLE}: cannot use {path} as the sandbox's memo: {exc}") from exc

    @classmethod
    def from_environment(cls, *, model_digest: str) -> Memo | None:
        """The memo ``$QUANTHUNT_SANDBOX_MEMO`` names, or None when it is unset or empty."""
        path = os.environ.get(VARIABLE, "").strip()
        return cls(Path(path), model_digest=model_digest) if path else None

    def _key(self, kind: str, precision: str, request: object) -> bytes:
        return hashlib.sha256(orjson.dumps([self._namespace, kind, precision, request])).digest()

    def _get(self, key: bytes) -> Any:
        with self._lock:
            row = self._db.execute("SELECT answer FROM answers WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        self.hits += 1
        return orjson.loads(row[0])

    def _put(self, key: bytes, answer: object) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO answers (key, answer) VALUES (?, ?)", (key, orjson.dumps(answer)))

    def answer(self, kind: str, precision: str, payload: Any) -> Any:
        """The kept answer to ``payload`` at ``precision``, or None: a ``Sample`` for a
        ``SamplingRequest`` (kind ``sample``), the scores of ``(ids, top_logprobs)`` (``score``)."""
        raw = self._get(self._key(kind, precision, payload))
        if raw is None:
            return None
        if kind == "sample":
            return Sample(list(raw["ids"]), [_untoken(t) for t in raw["logprobs"]], raw["text"], raw["finish"])
        return [None if t is None else _untoken(t) for t in raw]

    def keep(self, kind: str, precision: str, payload: Any, answer: Sample | Sequence[TokenLogprob | None]) -> None:
        """Keep what ``answer`` computed for ``payload`` (as ``answer`` takes them)."""
        if isinstance(answer, Sample):
            raw: object = {"ids": answer.token_ids, "logprobs": [_token(t) for t in answer.logprobs],
                           "text": answer.text, "finish": answer.finish_reason}  # fmt: skip
        else:
            raw = [None if t is None else _token(t) for t in answer]
        self._put(self._key(kind, precision, payload), raw)

    def close(self) -> None:
        with self._lock:
            self._db.close()
