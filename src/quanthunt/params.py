"""``params.yaml``, typed. One section per stage plus the shared ones; unknown keys,
wrong types and impossible values are refused with the file and the field named.
Every field is required: ``params.yaml`` is the one place a value is set and documented
(a model here carries the rule a value must keep, never a competing default).

Usage: ``params = load_params(Path("params.yaml"))``
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quanthunt import urls
from quanthunt.config_files import one_line, parse_yaml, read_text, validated
from quanthunt.errors import ConfigError
from quanthunt.spec import Quantization

SANDBOX = "sandbox"
"""A base URL of ``sandbox`` starts the built-in sandbox for the stage's duration."""

MAX_INT = 2**63 - 1
"""Integers must fit in 64 bits (what JSON APIs, SQLite and the sandbox accept)."""
MAX_FLOAT = 1e15
"""Larger magnitudes are no real budget, price, ratio or duration (and overflow the survey's arithmetic)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    @field_validator("*")
    @classmethod
    def _in_range(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError("must fit in a 64-bit integer")
        if isinstance(value, float) and abs(value) > MAX_FLOAT:
            raise ValueError(f"must be at most {MAX_FLOAT:g} in magnitude")
        return value


def check_base_url(value: str) -> str:
    """``sandbox`` (the built-in one), or a URL ``urls.check_base_url`` accepts."""
    if value == SANDBOX:
        return value
    return urls.check_base_url(value)


def _check_file_name(value: str) -> str:
    if not value or "\x00" in value:
        raise ValueError("must be a non-empty path without NUL characters")
    return value


class Paths(_Section):
    """Every file the pipeline reads or writes, defined once (dvc.yaml uses ``${paths.*}``)."""

    survey_providers: str
    survey_plan: str
    survey_metrics: str
    prompts: str
    """Folder of prompt datasets, one ``<dataset>.jsonl`` (or ``.parquet``) each."""
    verdicts: str
    verify_report: str
    verify_plots: str
    verify_metrics: str
    calibration: str
    """What ``calibrate`` measured on the controls: the margins verify uses (its verdicts carry them on)."""
    generated: str
    """``<dataset>.jsonl`` per dataset: the regenerated records of the last finished run."""
    generating: str
    """``<dataset>-<params hash>.jsonl``: records as they are generated, one file per
    sampling params (resumable; copied to ``generated`` when a run finishes)."""
    generate_reports: str
    final: str
    """``<dataset>.jsonl`` (SpecForge / EAGLE-3 form) and ``<dataset>.card.json`` per dataset."""
    validate_reports: str
    report: str
    plots_verification: str
    plots_cost: str
    locks: str
    logs: str

    _check = field_validator("*")(_check_file_name)

    def prompt_file(self, root: Path, dataset: str) -> Path:
        """``<prompts>/<dataset>.jsonl``, or ``.parquet`` when only that exists."""
        folder = root / self.prompts
        jsonl = folder / f"{dataset}.jsonl"
        parquet = folder / f"{dataset}.parquet"
        return parquet if parquet.exists() and not jsonl.exists() else jsonl

    def of(self, root: Path, dataset: str) -> DatasetFiles:
        """Every file of one dataset, named here once (``dvc.yaml`` spells the same names)."""
        return DatasetFiles(
            prompts=self.prompt_file(root, dataset),
            generating=root / self.generating,
            generated=root / self.generated / f"{dataset}.jsonl",
            generate_report=root / self.generate_reports / f"{dataset}.json",
            generate_detail=root / self.generate_reports / f"{dataset}.detail.json",
            final=root / self.final / f"{dataset}.jsonl",
            card=root / self.final / f"{dataset}.card.json",
            validate_report=root / self.validate_reports / f"{dataset}.json",
            lock=root / self.locks / f"{dataset}.lock",
            name=dataset,
        )

    def plot(self, root: Path, tag: str) -> Path:
        """An endpoint's verification plot (``deepinfra/fp4`` -> ``<verify_plots>/deepinfra-fp4.png``)."""
        return root / self.verify_plots / (re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-") + ".png")


@dataclass(frozen=True)
class DatasetFiles:
    """One dataset's files (``Paths.of``)."""

    name: str
    prompts: Path
    generating: Path
    generated: Path
    generate_report: Path
    generate_detail: Path
    final: Path
    card: Path
    validate_report: Path
    lock: Path

    def working(self, params_hash: str) -> Path:
        """Where the records are generated: one file per sampling params (their hash keys
        the ledger too), so new params make a new dataset and the old params' file stays
        whole, ready to be published again when they come back."""
        return self.generating / f"{self.name}-{params_hash[:12]}.jsonl"

    def set_aside(self, params_hash: str) -> Path:
        """Records of the working file that were made again (``quanthunt.refill``), kept."""
        return self.generating / "replaced" / f"{self.name}-{params_hash[:12]}.jsonl"


class Api(_Section):
    base_url: str
    _check = field_validator("base_url")(check_base_url)


class Reference(_Section):
    base_url: str
    model: str | None
    """The served model's name; null: the first one ``/models`` lists."""
    _check = field_validator("base_url")(check_base_url)


def _plain_json(value: Any) -> bool:
    """Whether ``value`` is JSON every server decodes alike: no NaN, infinity or integer past 64 bits."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in value.items())
    return False


class Reasoning(_Section):
    """How the target model's thinking is handled, by verify and generate alike."""

    mode: Literal["none", "off", "on"]
    """``none``: not a reasoning model (nothing is asked). ``off``: thinking disabled on both
    sides (the gateway's ``reasoning: {effort: "none"}``, the reference's chat template with
    ``template_kwargs``): answers alone are verified and bought. ``on``: the model thinks;
    verify teacher-forces prompt + reasoning + ``end_marker`` + answer and aligns over the
    whole stream, and generated turns keep their reasoning."""
    template_kwargs: dict[str, Any]
    """``chat_template_kwargs`` that turn thinking off at the reference (Kimi K2.5:
    ``thinking: false``; Qwen3: ``enable_thinking: false``)."""
    end_marker: str = Field(min_length=1)
    """The text between a reply's reasoning and its answer in the model's own output."""

    @field_validator("template_kwargs")
    @classmethod
    def _argument_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, argument in value.items():
            if not name.isidentifier():
                raise ValueError(f"chat template arguments are names, got {one_line(repr(name), 40)}")
            if not _plain_json(argument):  # they travel as JSON to the reference's template engine
                raise ValueError(f"{name} must be plain JSON (finite, 64-bit numbers), got {one_line(repr(argument), 40)}")
        return value

    def request(self) -> dict[str, str] | None:
        """The chat request's ``reasoning`` object: effort ``none`` turns thinking off."""
        return {"effort": "none"} if self.mode == "off" else None

    def reference_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` for the reference's tokenize and chat calls."""
        return dict(self.template_kwargs) if self.mode == "off" else None


class Sandbox(_Section):
    roster: str | None
    """A roster YAML path; ``null`` is the roster shipped with quanthunt."""

    _check = field_validator("roster")(lambda v: None if v is None else _check_file_name(v))


class Tracking(_Section):
    experiment: str = Field(min_length=1)


class Coordination(_Section):
    """How the hosts working one job on a shared ledger keep time with each other
    (``quanthunt.shared``; published with the job, so workers need no params file)."""

    heartbeat_s: float = Field(gt=0)
    """A worker says it is alive this often (and reaps the dead while at it)."""
    dead_after_s: float = Field(gt=0)
    """A worker whose heartbeat is this old, by the server's clock, is presumed dead."""
    claim: int = Field(ge=1)
    """Records a worker claims at once."""
    lease_requests: int = Field(ge=1)
    """A budget lease covers this many requests at their worst-case cost."""

    @model_validator(mode="after")
    def _beats_before_death(self) -> Coordination:
        if self.dead_after_s < 3 * self.heartbeat_s:
            raise ValueError("dead_after_s must be at least 3 heartbeats (a late beat is not a death)")
        return self


class LedgerSettings(_Section):
    """Where the request ledger is (``quanthunt.ledger``): a SQLite file for one host, or a
    PostgreSQL database that many hosts share. ``$QUANTHUNT_LEDGER_URL`` overrides it."""

    url: str
    team: str = Field(min_length=1, max_length=200)
    """On a shared ledger: the team budget every run draws from, capped at
    ``survey.budget.usd`` (runs of one team, whoever starts them, share it)."""
    coordination: Coordination

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        urls.check_ledger_url(value)
        if urlsplit(value).password is not None:
            raise ValueError(
                "a password does not belong in params.yaml (it is committed): set PGPASSWORD, use ~/.pgpass, "
                "or put the whole URL in $QUANTHUNT_LEDGER_URL"
            )
        return value


class Policy(_Section):
    """Which providers the survey keeps as candidates."""

    allowed_quantizations: tuple[Quantization, ...]
    """Declared precisions accepted. Declared ``unknown`` stays a candidate: verification decides."""
    ignore_providers: tuple[str, ...]
    """Provider names, slugs or tags never to use."""
    max_prompt_usd_per_m: float | None = Field(ge=0)
    """Highest prompt price accepted, USD per million tokens (null: any)."""
    max_completion_usd_per_m: float | None = Field(ge=0)
    """Highest completion price accepted, USD per million tokens (null: any)."""
    min_uptime: float = Field(ge=0, le=100)
    """Minimum ``uptime_last_30m`` in percent."""
    min_status: int = Field(le=0)
    """Lowest endpoint status accepted (0 healthy, -1/-2 degraded, -3 and below down)."""
    require_logprobs: bool
    """Exclude endpoints that do not return logprobs (false: verification audits them in sample mode)."""


class PurchasePlan(_Section):
    """What the team wants to buy, and with how much money."""

    usd: float = Field(gt=0)
    """The money for the whole purchase, in USD: the survey prices the target (``datasets`` ×
    ``output_tokens_per_dataset`` output tokens and their prompt tokens) at each provider against it."""
    datasets: int = Field(ge=1)
    """Datasets the purchase is for."""
    output_tokens_per_dataset: int = Field(ge=1)
    """Output (completion) tokens to buy for each dataset."""
    input_tokens_per_output_token: float = Field(ge=0)
    """Prompt tokens sent per output token bought, to estimate input cost (0: ignore it)."""


class Survey(_Section):
    model: str = Field(pattern=r"^[A-Za-z0-9._-]+/[A-Za-z0-9._:-]+$")
    """OpenRouter model id, ``author/slug``."""
    policy: Policy
    budget: PurchasePlan


class Probes(_Section):
    """The verification probe design, per round (the survey prices it for the budget plan)."""

    prompts: int = Field(ge=2)
    """Probe prompts per round: every undecided provider gets the next this many."""
    completions_per_prompt: int = Field(ge=1)
    """Completions per prompt in logprob mode."""
    sample_mode_completions_per_prompt: int = Field(ge=1)
    """Completions per prompt in sample mode (no provider logprobs)."""
    max_tokens: int = Field(ge=1)
    temperature: float = Field(gt=0, le=2)
    """Must be 1: the sampler check compares the sampled tokens with the reference's raw
    distribution, which is the sampling distribution only at T = 1 (and top-p 1)."""
    top_logprobs: int = Field(ge=1, le=20)
    mean_prompt_tokens: int = Field(ge=1)
    """Expected prompt length in tokens, for the cost estimate."""

    @field_validator("temperature")
    @classmethod
    def _raw_distribution(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError(
                "must be 1.0: the sampler check tests the sampled tokens against the reference's raw "
                "distribution, which is what a sampler draws from only at temperature 1"
            )
        return value


class Margins(_Section):
    """Tolerances, calibrated so a faithful provider on other hardware (bf16 compute) is
    equivalent (``benchmarks/verify_power.py`` measures them)."""

    mean_abs_dlogprob: float = Field(gt=0)
    """Logprob mode: largest mean |Δ logprob| per token that counts as the same model."""
    tail_dlogprob: float = Field(gt=0)
    """Logprob mode: a completion whose mean |Δ| exceeds this is extreme (and the mean
    test clips each completion here)."""
    tail_p0: float = Field(gt=0, lt=1)
    """Share of extreme completions a faithful provider may produce."""
    sampler_shift: float = Field(gt=0, lt=0.5)
    """Both modes: mean Φ(rank z) further than this from ½ → different (½ for the
    reference's own sampler)."""
    sampler_equivalence: float = Field(gt=0, lt=0.5)
    """Both modes: mean Φ(rank z) shown within ½ ± this → equivalent (wider than
    ``sampler_shift``: a margin as tight as a faithful provider's own shift would take
    thousands of completions to show from inside)."""
    sample_tail_z: float = Field(gt=0)
    """A completion whose rank z exceeds this is extreme (both modes)."""
    sample_tail_p0: float = Field(gt=0, lt=1)
    """Share of extreme-z completions a faithful provider may produce (1 - Φ(2) = 2.3 %
    for the reference's own text; bf16 compute shifts z up a little: 3.8 % measured)."""

    @model_validator(mode="after")
    def _ordered(self) -> Margins:
        if self.sampler_equivalence < self.sampler_shift:
            raise ValueError("sampler_equivalence must be at least sampler_shift")
        if self.tail_dlogprob <= self.mean_abs_dlogprob:
            raise ValueError("tail_dlogprob must exceed mean_abs_dlogprob")
        return self


class Decision(_Section):
    alpha: float = Field(gt=0, lt=1)
    correction: Literal["holm", "bh"]
    """Across providers: Holm on anytime-valid p-values (family-wise error) or e-BH (false
    discovery rate, any dependence)."""
    min_power: float = Field(gt=0, lt=1)
    """``equivalent`` needs the audit to have had at least this chance of catching a
    ``mixture_share`` mixture."""
    mixture_share: float = Field(gt=0, le=1)
    """The smallest share of lower-precision traffic the audit must be able to catch."""
    mixture_detection_logprob: float = Field(gt=0, le=1)
    """Share of a coarse precision's completions flagged extreme in logprob mode (measured
    by ``benchmarks/verify_power.py`` on NVFP4: the lower end of its 95 % interval)."""
    mixture_detection_sample: float = Field(gt=0, le=1)
    """The same in sample mode (rank z beyond ``sample_tail_z``)."""
    mixture_detection_tokens: int = Field(ge=1)
    """The probe length (``probes.max_tokens``) both rates were measured at: shorter probes
    flag fewer coarse completions, so the stage refuses them until the rates are measured
    again (``benchmarks/verify_power.py --tokens``). Also the rank statistic's horizon: the
    first this many tokens of every completion, the stop token among them, a shorter one
    padded to it (``measurements.rank``), in verify, calibrate and generate's monitor."""
    max_failed_share: float = Field(ge=0, le=1)
    """More failed probe requests than this makes a provider inconclusive."""


class Verify(_Section):
    seed: int
    probes: Probes
    max_probes_per_provider: int = Field(ge=2)
    """Probe prompts a provider is audited with at most (over all rounds) before it is
    ``inconclusive``."""
    margin: Margins
    decision: Decision
    audit_declared_excluded: bool
    """Also audit providers the survey excluded only for their declared precision, to check
    the declaration (they stay excluded whatever the verdict)."""
    max_cost_usd: float = Field(gt=0)
    """The stage refuses to start when the planned probe cost (every provider audited to
    ``max_probes_per_provider``) exceeds this."""
    concurrency: int = Field(ge=1, le=2000)
    """Probe requests in flight at most at each endpoint: the ceiling of its adaptive limit,
    which halves when a request to it times out and grows back as its requests succeed
    (``quanthunt.congestion``, one limit per endpoint: ``Auditor.limit``); also the most
    completions scored at the reference at once."""
    max_attempts: int = Field(ge=1, le=10)
    request_timeout_s: float = Field(gt=0, le=3600)
    """How long a probe request may wait for its reply once sent, plus ``max_tokens`` at the
    slowest output rate (``gateway.read_timeout_s``); time queued behind our own limit does
    not count. A request that times out is retried under the lowered limit."""
    reference_retry_for_s: float = Field(gt=0, le=86_400)
    """Once the audit is under way, how long a reference request that timed out, was
    refused or got a 408/429/5xx is retried before the stage stops (exit 2, nothing
    written). The reference is the team's own server, free to ask again, and a paid reply
    it could not score is not the provider's failure: it is never counted against one."""
    reuse_paid_replies_h: float = Field(ge=0, le=8760)
    """A probe request an earlier run bought at most this many hours ago is answered from
    the ledger instead of being bought again (``quanthunt.paid_replies``); 0 buys every
    reply anew. Long enough for reruns after a changed margin or a stopped reference;
    short enough that an audit a week later measures the providers again."""

    @model_validator(mode="after")
    def _rounds(self) -> Verify:
        if self.max_probes_per_provider < self.probes.prompts:
            raise ValueError("max_probes_per_provider must be at least probes.prompts (one round)")
        if self.probes.max_tokens < self.decision.mixture_detection_tokens:
            raise ValueError(
                f"probes.max_tokens {self.probes.max_tokens} is shorter than the "
                f"{self.decision.mixture_detection_tokens} tokens decision.mixture_detection_* were measured at: "
                "shorter probes flag fewer coarse completions; measure the rates again (benchmarks/verify_power.py "
                "--tokens) and set them with decision.mixture_detection_tokens"
            )
        return self


REFERENCE_CONTROL = "reference"


def check_deployment_url(value: str) -> str:
    """``reference`` (the reference deployment itself), ``sandbox:<deployment>`` (one of the
    sandbox roster's ``deployments``) or a base URL (``.../v1``) ``urls.check_base_url`` accepts."""
    if value == REFERENCE_CONTROL:
        return value
    if value.startswith(f"{SANDBOX}:"):
        name = value.removeprefix(f"{SANDBOX}:")
        if not urls.DEPLOYMENT_NAME.fullmatch(name):
            raise ValueError(f"sandbox:<deployment> needs a deployment name of a-z, 0-9 and -, got {one_line(repr(name), 80)}")
        return value
    return urls.check_base_url(value)


class Calibrate(_Section):
    """Margins measured on deployments the team trusts (``quanthunt.calibration_run``)."""

    controls: dict[str, str]
    """Faithful deployments of the reference's model by name: a base URL (``.../v1``; a
    second server on other GPUs or dtype), ``sandbox:<deployment>``, or ``reference``: the
    reference's own samples, measured as a provider's are (its sampler, and its decoding
    against its own scoring). Empty: verify uses the shipped ``verify.margin`` and says so."""
    coarse: str | None
    """A coarser build of the same model (e.g. vLLM ``--quantization fp8``), whose completions
    give the mixture detection rates; null: the shipped ``verify.decision`` rates, said so."""
    prompts: int = Field(ge=1)
    """Probe prompts measured at each control (the verify plan's first ones)."""
    completions_per_prompt: int = Field(ge=1)
    confidence: float = Field(gt=0.5, lt=1)
    """Every bound of one calibration holds jointly at this confidence."""
    concurrency: int = Field(ge=1, le=256)
    """Completions in flight at each control and scored at the reference at once."""

    @field_validator("controls")
    @classmethod
    def _controls(cls, value: dict[str, str]) -> dict[str, str]:
        for name, url in value.items():
            if not urls.DEPLOYMENT_NAME.fullmatch(name):
                raise ValueError(f"control names are a-z, 0-9 and -, got {one_line(repr(name), 80)}")
            try:
                check_deployment_url(url)
            except ValueError as exc:
                raise ValueError(f"control {name}: {exc}") from None
        return value

    _coarse = field_validator("coarse")(lambda value: None if value is None else check_deployment_url(value))


class Sampling(_Section):
    """How generation samples (``generate.sampling``); its values key the ledger and the
    working file (``generation.params_hash``)."""

    temperature: float = Field(ge=0, le=2)
    top_p: float = Field(gt=0, le=1)
    max_tokens: int = Field(ge=1)
    seed: int | None
    """Each request's seed derives from this, the record and the turn; null sends none."""

    def request_seed(self, record_id: str, turn: int) -> int | None:
        if self.seed is None:
            return None
        return int(hashlib.sha256(f"{self.seed}:{record_id}:{turn}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


class Retry(_Section):
    """How a failed generation request is retried (``generate.retry``)."""

    max_attempts: int = Field(ge=1, le=100)
    base_delay_s: float = Field(ge=0)
    max_delay_s: float = Field(ge=0)
    empty_answer_max_tokens: int | None = Field(ge=1)
    """``max_tokens`` of a turn asked again after an empty answer (a reasoning model's
    thinking ate the budget); null: the same budget again."""

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Exponential backoff with full jitter."""
        return rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))


class Monitor(_Section):
    """Re-verification during generation (``quanthunt.monitor``)."""

    share: float = Field(ge=0, le=1)
    """Share of each provider's production requests that also ask for logprobs (sample
    mode: whose text is scored) and are scored at the reference in the background. 0: off."""
    alpha: float = Field(gt=0, lt=1)
    """Chance that any faithful provider is ever stopped, over every dataset of one
    verification (divided across providers and datasets)."""
    checkpoint_every: int = Field(ge=1)
    """Monitored replies per checkpoint: records served since the checkpoint before the
    estimated change are quarantined."""
    concurrency: int = Field(ge=1, le=256)
    """Scorings in flight at the reference."""
    max_unscored: int = Field(ge=1)
    """Monitored replies of one provider still waiting for their score: beyond it the
    provider gets no new requests (the others take them) until the reference catches up,
    so what a provider serves unvetted stays bounded however slow the reference."""


class Generate(_Section):
    max_records: int | None = Field(ge=1)
    """Records taken from each dataset, in file order (null: all)."""
    sampling: Sampling
    concurrency: int = Field(ge=1, le=20000)
    ramp_up_s: float = Field(ge=0, le=600)
    """The first ``concurrency`` requests are spread over this many seconds (0: all at once)."""
    max_usd_per_run: float = Field(gt=0)
    """Hard cap on one run's spend, whatever the concurrency."""
    max_output_tokens: int | None = Field(ge=1)
    """Token budget per dataset, all runs together (null: none)."""
    data_collection: Literal["allow", "deny"]
    quantizations: tuple[Quantization, ...] | None
    """Also filter on declared quantization in the routing request (null: verification decides)."""
    retry: Retry
    monitor: Monitor
    request_timeout_s: float = Field(gt=0)
    """A request with no complete reply after this long is abandoned (possibly billed) and retried."""
    stop_grace_s: float = Field(ge=0)
    """After a first Ctrl-C or SIGTERM, requests in flight get this long to come back (they
    are paid for either way) before they are cut off; a second Ctrl-C cuts them off at once."""
    progress_interval_s: float = Field(gt=0)
    """Seconds between plain progress lines when the output is not a terminal."""


class Validate(_Section):
    max_truncated_share: float = Field(ge=0, le=1)
    """Largest share of assistant turns that may stop at ``max_tokens`` (before they are
    removed from the export); beyond it the stage fails: raise ``max_tokens``."""
    unfinished: Literal["cut", "drop"]
    """A record with an unfinished turn (cut at ``max_tokens``, filtered) is exported up
    to the turn before it (``cut``; dropped if that is its first) or not at all (``drop``)."""
    max_failure_examples: int = Field(ge=1, le=100)


class Params(_Section):
    """The whole ``params.yaml``."""

    paths: Paths
    api: Api
    reference: Reference
    reasoning: Reasoning
    sandbox: Sandbox
    tracking: Tracking
    ledger: LedgerSettings
    datasets: tuple[str, ...] = Field(min_length=1)
    """Prompt datasets, by name: ``<paths.prompts>/<name>.jsonl``."""
    survey: Survey
    calibrate: Calibrate
    verify: Verify
    generate: Generate
    validate_: Validate = Field(alias="validate")

    @field_validator("datasets")
    @classmethod
    def _dataset_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name or "/" in name or "\x00" in name or name.startswith("."):
                raise ValueError(f"dataset names are file stems, got {one_line(repr(name), 80)}")
        if len(set(value)) != len(value):
            raise ValueError("dataset names must be unique")
        return value

    def check_dataset(self, dataset: str, *, source: Path) -> None:
        """``ConfigError`` unless ``dataset`` is one of ``datasets``."""
        if dataset not in self.datasets:
            raise ConfigError(f"{source}: datasets has no {dataset!r} (it lists {', '.join(self.datasets)})")

    @property
    def uses_sandbox(self) -> bool:
        return SANDBOX in (self.api.base_url, self.reference.base_url)


def section_digest(section: BaseModel) -> str:
    """sha256 of a section's resolved values (what a run's params-hash tag holds)."""
    return hashlib.sha256(json.dumps(section.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def parse_params(data: Any, *, source: str) -> Params:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (paths, api, survey, ...)")
    return validated(Params, data, source=source)


def load_params(path: Path) -> Params:
    """Read and validate ``params.yaml``; every problem is one line naming file and field."""
    text = read_text(path, what="params")
    return parse_params(parse_yaml(text, source=str(path), what="params"), source=str(path))
