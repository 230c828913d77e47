"""Credit accounts of the sandbox's API keys, as OpenRouter keeps them.

Any non-empty bearer key is accepted and starts with the roster's default credit; a
roster may give keys their own limit. Keys are held only as sha256 digests: the
sandbox never stores, logs or echoes a key. A request first *reserves* its worst-case
cost (so concurrent requests cannot overdraw the key), then *settles* at its actual
``usage.cost`` or *releases* the reservation if nothing was billed.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from quanthunt.sandbox.roster import Credits


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_label(key: str) -> str:
    """A masked label like OpenRouter's (``sk-or-v1-au7...890``), never the key itself."""
    return f"{key[:3]}...{key[-2:]}" if len(key) > 8 else "***"


@dataclass
class Account:
    limit: float
    usage: float = 0.0
    reserved: float = 0.0
    has_own_limit: bool = False
    requests_billed: int = 0

    @property
    def remaining(self) -> float:
        return max(self.limit - self.usage, 0.0)


class Refusal(Exception):
    """A 402: ``limit_source`` is ``openrouter_credits``, ``openrouter_key_limit`` or
    ``openrouter_in_flight_budget`` (transient: retry after ``retry_after_s``)."""

    def __init__(self, limit_source: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.limit_source = limit_source
        self.retry_after_s = retry_after_s


class Billing:
    """All key accounts of one sandbox process."""

    def __init__(self, credits: Credits) -> None:
        self._default = credits.default_usd
        self._accounts: dict[str, Account] = {
            key_digest(k.key): Account(limit=k.limit_usd, has_own_limit=True) for k in credits.keys
        }
        self._lock = threading.Lock()

    def account(self, key: str) -> Account:
        digest = key_digest(key)
        with self._lock:
            if digest not in self._accounts:
                self._accounts[digest] = Account(limit=self._default)
            return self._accounts[digest]

    def reserve(self, key: str, worst_case_usd: float) -> float:
        """Hold ``worst_case_usd`` against the key or raise ``Refusal``."""
        account = self.account(key)
        with self._lock:
            if account.remaining <= 0 or worst_case_usd > account.remaining:
                source = "openrouter_key_limit" if account.has_own_limit else "openrouter_credits"
                raise Refusal(
                    source,
                    f"Insufficient credits: this request needs up to ${worst_case_usd:.6f}, ${account.remaining:.6f} remains",
                )
            if account.reserved + worst_case_usd > account.remaining:
                raise Refusal(
                    "openrouter_in_flight_budget",
                    "Requests in flight have reserved the remaining credit; retry shortly",
                    retry_after_s=1.0,
                )
            account.reserved += worst_case_usd
        return worst_case_usd

    def settle(self, key: str, reserved_usd: float, cost_usd: float) -> None:
        """Release the reservation and charge the actual cost."""
        account = self.account(key)
        with self._lock:
            account.reserved = max(account.reserved - reserved_usd, 0.0)
            account.usage += cost_usd
            if cost_usd > 0:
                account.requests_billed += 1

    def release(self, key: str, reserved_usd: float) -> None:
        self.settle(key, reserved_usd, 0.0)

    def add_credit(self, key: str, usd: float) -> Account:
        account = self.account(key)
        with self._lock:
            account.limit += usd
        return account

    def totals(self) -> dict[str, float]:
        """Charged USD per key digest (what the sandbox billed, for reconciliation)."""
        with self._lock:
            return {digest: a.usage for digest, a in self._accounts.items()}
