"""What one generate run of one dataset is asked to do, and what it counts as it goes: the
endpoints it may use (``Eligible``, as verification judged them), the ``Job``, the hash of
what a record's content depends on (it keys the ledger and the working file), and the
run's live ``Progress``.
"""

from __future__ import annotations

import hashlib
import json
import operator
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, overload

from quanthunt.gateway import Routing
from quanthunt.params import Generate, Params, Retry, Sampling
from quanthunt.verdicts import ProviderVerdict

T = TypeVar("T")


class Held(Generic[T]):
    """A read-only attribute that one of the object's fields holds: in a class body,
    ``tag = Held[str]("judged.tag")`` reads ``self.judged.tag``. A job keeps the params
    section and the verdicts it was made from whole, and its readers read their parts."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._read = operator.attrgetter(path)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Held[T]: ...
    @overload
    def __get__(self, obj: object, owner: type[Any]) -> T: ...
    def __get__(self, obj: object | None, owner: type[Any]) -> Held[T] | T:
        if obj is None:
            return self
        return cast(T, self._read(obj))


@dataclass(frozen=True)
class Eligible:
    """An endpoint generation may use: verification's verdict on it, and what the survey
    says it charges and holds."""

    judged: ProviderVerdict
    """The endpoint's entry in ``verdicts.json``, whole: ``name``, ``tag``, ``verdict``, ... read it."""
    prompt_usd_per_token: float
    completion_usd_per_token: float
    context_length: int
    siblings: tuple[str, ...] = ()
    """The gateway's other endpoint tags (``Routing.pin`` ignores the variants a base slug
    would also reach)."""

    name = Held[str]("judged.provider")
    """The provider's name (several endpoints may share it)."""
    tag = Held[str]("judged.tag")
    declared_quantization = Held[str]("judged.declared_quantization")
    verdict = Held[str]("judged.verdict")
    verdict_run_id = Held[str | None]("judged.mlflow_run_id")
    """The MLflow run that measured this endpoint (nested in the verification run)."""

    def provenance(self) -> dict[str, str | None]:
        """Who served a turn, as its provenance names it."""
        return {
            "provider": self.name,
            "endpoint_tag": self.tag,
            "declared_quantization": self.declared_quantization,
            "verdict": self.verdict,
            "verdict_run_id": self.verdict_run_id,
        }

    @property
    def weight(self) -> float:
        """OpenRouter's load-balancing weight: 1 / price²."""
        return 1.0 / max(self.prompt_usd_per_token + self.completion_usd_per_token, 1e-12) ** 2


@dataclass(frozen=True)
class Job:
    """Everything one run of one dataset needs to know."""

    dataset: str
    model: str
    providers: tuple[Eligible, ...]
    routing: Routing
    """Preferences every request carries (data collection, quantizations); each request
    is pinned to one endpoint on top of them."""
    params_hash: str
    run_id: str
    settings: Generate
    """The ``generate`` section the run was started with, published whole: its sampling,
    budgets, retry bounds and ramp are read through the attributes below."""
    concurrency: int
    """Requests in flight on this host: ``settings.concurrency``, unless a worker asks for
    its own (``quanthunt worker --concurrency``; the published job keeps the coordinator's)."""
    verification_run_id: str | None
    reasoning: Mapping[str, Any] | None = None
    """The request's ``reasoning`` object (``Reasoning.request()``: thinking off, or unset)."""

    sampling = Held[Sampling]("settings.sampling")
    max_usd = Held[float]("settings.max_usd_per_run")
    """Hard cap on this run's spend (settled plus possibly-billed)."""
    max_output_tokens = Held[int | None]("settings.max_output_tokens")
    """Token budget of the dataset (all runs together)."""
    ramp_up_s = Held[float]("settings.ramp_up_s")
    """The first wave is spread over this long: worker k starts after k/concurrency of it."""
    retry = Held[Retry]("settings.retry")

    @property
    def worst_prompt_rate(self) -> float:
        return max(p.prompt_usd_per_token for p in self.providers)

    @property
    def worst_completion_rate(self) -> float:
        return max(p.completion_usd_per_token for p in self.providers)

    @property
    def context_length(self) -> int:
        return min(p.context_length for p in self.providers)


def params_hash(model: str, sampling: Mapping[str, Any], reasoning: str = "none") -> str:
    """What a record's content depends on: the model, the sampling params and whether a
    reasoning model thinks (``reasoning.mode``; ``none`` leaves the hash as it was before
    the mode existed). Concurrency, budgets and retry bounds may change between runs
    without starting a dataset over."""
    keyed: dict[str, Any] = {"model": model, "sampling": dict(sampling)}
    if reasoning != "none":
        keyed["reasoning"] = reasoning
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def dataset_params_hash(params: Params) -> str:
    """``params_hash`` of what ``params.yaml`` sets: it keys the ledger and the working file."""
    return params_hash(params.survey.model, params.generate.sampling.model_dump(mode="json"), params.reasoning.mode)


@dataclass
class Progress:
    """Live counters of a run (the progress display and the summary read them)."""

    records_total: int = 0
    """Records of the dataset to generate (``generate.max_records`` of them at most), done or not."""
    records_done_before: int = 0
    """Records earlier runs finished (this one resumes after them)."""
    records_done: int = 0
    """Records this run finished: every turn answered and the line written."""
    records_failed: int = 0
    """Records given up on this run (a turn failed for good); a later run tries them again."""
    records_skipped: int = 0
    """Records never sent: ``skipped_reasons`` says why."""
    requests_ok: int = 0
    in_flight: int = 0
    """Requests sent and not answered yet."""
    output_tokens_before: int = 0
    """Completion tokens of the turns earlier runs answered (the dataset's token budget counts both)."""
    output_tokens: int = 0
    """Completion tokens of the replies this run kept."""
    retries: Counter[str] = field(default_factory=Counter)
    """Attempts retried, by what went wrong."""
    errors: Counter[str] = field(default_factory=Counter)
    """Attempts that failed or whose reply could not be used, by kind, retried or not."""
    providers: Counter[str] = field(default_factory=Counter)
    """Replies by endpoint tag."""
    quarantined: int = 0
    retired: dict[str, str] = field(default_factory=dict)
    """Endpoints dropped for the rest of the run (tag -> why)."""
    limit_cuts: dict[str, int] = field(default_factory=dict)
    """Times each endpoint's in-flight limit was halved after a timeout (tag -> cuts)."""
    monitor_stops: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Providers their monitor stopped this run (tag -> ``monitor.Stop`` fields, and the
    replies it had served this run when the stop came: ``providers`` minus it is what was
    in flight or already sent while its last monitored replies were being scored)."""
    started: float = field(default_factory=time.monotonic)
    stop_reason: str | None = None
    skipped_reasons: Counter[str] = field(default_factory=Counter)
    workers: list[dict[str, Any]] = field(default_factory=list)
    """On a shared ledger, what every worker of the run did, as the ledger has it
    (``shared.worker_figures``); empty on one host."""
