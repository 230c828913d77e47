"""The ledger's schema, the same for every backend but for the column types in which the
databases differ (``Dialect``). Migrations are named functions, applied in order; each
backend records them by number in ``schema_migrations``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quanthunt.ledger import Transaction


def run_script(tx: Transaction, script: str) -> None:
    """A migration's statements, one at a time, in the caller's transaction."""
    for statement in filter(str.strip, script.split(";")):
        tx.execute(statement)


@dataclass(frozen=True)
class Dialect:
    """The column types in which the two databases differ."""

    real: str
    identity: str
    """An auto-numbered integer primary key."""


def requests_and_attempts(tx: Transaction, types: Dialect) -> None:
    run_script(
        tx,
        f"""
        CREATE TABLE requests (
            dataset TEXT NOT NULL,
            record_id TEXT NOT NULL,
            turn INTEGER NOT NULL,
            params_hash TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('pending','in_flight','done','failed','unknown_outcome','quarantined')),
            attempts INTEGER NOT NULL DEFAULT 0,
            reserved_usd {types.real} NOT NULL DEFAULT 0,
            settled_usd {types.real} NOT NULL DEFAULT 0,
            provider TEXT,
            generation_id TEXT,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            reply TEXT,
            last_error TEXT,
            created_at {types.real} NOT NULL,
            updated_at {types.real} NOT NULL,
            PRIMARY KEY (dataset, record_id, turn, params_hash)
        );
        CREATE TABLE attempts (
            id {types.identity},
            dataset TEXT NOT NULL,
            record_id TEXT NOT NULL,
            turn INTEGER NOT NULL,
            params_hash TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            run_id TEXT NOT NULL,
            started_at {types.real} NOT NULL,
            finished_at {types.real},
            outcome TEXT CHECK (outcome IS NULL OR outcome IN
                ('ok','failed_unbilled','failed_billed','unknown','quarantined','reconciled')),
            http_status INTEGER,
            error_kind TEXT,
            provider TEXT,
            generation_id TEXT,
            reserved_usd {types.real} NOT NULL,
            cost_usd {types.real} NOT NULL DEFAULT 0,
            prompt_tokens INTEGER,
            completion_tokens INTEGER
        );
        CREATE INDEX attempts_by_key ON attempts (dataset, record_id, turn, params_hash);
        CREATE INDEX attempts_by_run ON attempts (run_id);
        CREATE TABLE records (
            dataset TEXT NOT NULL,
            record_id TEXT NOT NULL,
            params_hash TEXT NOT NULL,
            line_sha256 TEXT NOT NULL,
            line TEXT NOT NULL,
            written_at {types.real} NOT NULL,
            PRIMARY KEY (dataset, record_id, params_hash)
        );
        """,
    )


def monitors(tx: Transaction, types: Dialect) -> None:
    """The generate stage's monitors: one provider's state per verification and dataset
    (``quanthunt.monitor``)."""
    run_script(
        tx,
        f"""
        CREATE TABLE monitors (
            verification_run_id TEXT NOT NULL,
            dataset TEXT NOT NULL,
            tag TEXT NOT NULL,
            served INTEGER NOT NULL,
            state TEXT NOT NULL,
            stopped INTEGER NOT NULL DEFAULT 0,
            updated_at {types.real} NOT NULL,
            PRIMARY KEY (verification_run_id, dataset, tag)
        );
        CREATE TABLE monitor_path (
            verification_run_id TEXT NOT NULL,
            dataset TEXT NOT NULL,
            tag TEXT NOT NULL,
            idx INTEGER NOT NULL,
            e_value {types.real} NOT NULL,
            PRIMARY KEY (verification_run_id, dataset, tag, idx)
        );
        """,
    )


def probe_replies(tx: Transaction, types: Dialect) -> None:
    """The verify stage's paid probe replies, keyed by the request that bought them
    (``quanthunt.paid_replies``): a rerun on the same probes uses them instead of buying
    them again."""
    run_script(
        tx,
        f"""
        CREATE TABLE probe_replies (
            request_sha256 TEXT PRIMARY KEY,
            tag TEXT NOT NULL,
            probe_id TEXT NOT NULL,
            reply TEXT NOT NULL,
            cost_usd {types.real} NOT NULL,
            run_id TEXT NOT NULL,
            created_at {types.real} NOT NULL
        );
        """,
    )


def replaced_records(tx: Transaction, types: Dialect) -> None:
    """Records generate set aside to make again (a provider re-verified ``different``, or a
    stopped monitor's suspect replies: ``quanthunt.refill``): each line kept as it was
    written, with the turn it was made again from and why."""
    run_script(
        tx,
        f"""
        CREATE TABLE replaced_records (
            dataset TEXT NOT NULL,
            record_id TEXT NOT NULL,
            params_hash TEXT NOT NULL,
            line_sha256 TEXT NOT NULL,
            line TEXT NOT NULL,
            from_turn INTEGER NOT NULL,
            why TEXT NOT NULL,
            replaced_at {types.real} NOT NULL,
            PRIMARY KEY (dataset, record_id, params_hash, line_sha256)
        );
        """,
    )


MIGRATIONS: tuple[Callable[[Transaction, Dialect], None], ...] = (
    requests_and_attempts,
    monitors,
    probe_replies,
    replaced_records,
)
"""A local ledger's, in order: 1 the request ledger, 2 the generate stage's monitors, 3 the
verify stage's paid probe replies, 4 the records generate set aside to make again. A
shared ledger numbers its own (``ledger_postgres``): a migration keeps its number once
applied anywhere, so new ones go at the end."""
