"""The survey's computation: which providers are candidates, and what the data costs.

Pure functions of typed inputs (the stage does the I/O): ``apply_policy`` decides per
endpoint, ``plan_budget`` prices the purchase at the cheapest, median and worst
candidate, and what the verification probes cost.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quanthunt.errors import ConfigError
from quanthunt.params import Policy, PurchasePlan, Verify
from quanthunt.replies import Endpoint, ModelReasoning

CANDIDATE = "candidate"
SENT_PARAMETERS = ("max_tokens", "temperature", "top_p", "seed")
"""What the later stages send with every request: verification ``max_tokens``,
``temperature`` and ``seed``; generation also ``top_p``. With ``require_parameters: true``
an endpoint that does not list one of them answers 404 at generate time. (``logprobs``
and ``top_logprobs`` go only with logprob-mode probes: an endpoint without them is
audited in sample mode, ``Endpoint.supports_logprobs``.)"""
PROVIDER_COLUMNS = (
    "provider", "tag", "declared_quantization", "prompt_usd_per_m", "completion_usd_per_m", "discount",
    "price_note", "status", "uptime_last_30m", "context_length", "max_completion_tokens", "supports_logprobs",
    "decision", "reason",
)  # fmt: skip


@dataclass(frozen=True)
class ProviderRow:
    """One line of ``providers.csv``."""

    provider: str
    tag: str
    declared_quantization: str
    prompt_usd_per_m: float
    completion_usd_per_m: float
    discount: float
    price_note: str
    status: int | None
    uptime_last_30m: float | None
    context_length: int
    max_completion_tokens: int | None
    supports_logprobs: bool
    decision: str
    reason: str

    @property
    def is_candidate(self) -> bool:
        return self.decision == CANDIDATE

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _matches(endpoint: Endpoint, refs: Sequence[str]) -> bool:
    names = {endpoint.provider_name.lower(), endpoint.tag.lower(), endpoint.tag.split("/")[0].lower()}
    return any(ref.strip().lower() in names for ref in refs)


def _exclusion(endpoint: Endpoint, policy: Policy) -> str | None:
    """Why the policy excludes ``endpoint``, or None. Checks run in a fixed order, so the
    reason is the first that applies."""
    prompt, completion = endpoint.usd_per_million()
    if _matches(endpoint, policy.ignore_providers):
        return "excluded: ignored by policy"
    if endpoint.declared_quantization not in policy.allowed_quantizations:
        return f"excluded: declared {endpoint.declared_quantization}"
    if endpoint.status is not None and endpoint.status < policy.min_status:
        return f"excluded: status {endpoint.status}"
    if policy.min_uptime and (endpoint.uptime_last_30m is None or endpoint.uptime_last_30m < policy.min_uptime):
        return f"excluded: uptime {endpoint.uptime_last_30m} below {policy.min_uptime:g}"
    if policy.max_prompt_usd_per_m is not None and prompt > policy.max_prompt_usd_per_m + 1e-12:
        return "excluded: price above max"
    if policy.max_completion_usd_per_m is not None and completion > policy.max_completion_usd_per_m + 1e-12:
        return "excluded: price above max"
    unsupported = [p for p in SENT_PARAMETERS if p not in endpoint.supported_parameters]
    if unsupported:
        return f"excluded: does not support {', '.join(unsupported)}"
    if policy.require_logprobs and not endpoint.supports_logprobs:
        return "excluded: no logprobs"
    return None


def apply_policy(endpoints: Sequence[Endpoint], policy: Policy) -> list[ProviderRow]:
    """One row per endpoint with the policy's decision and its reason."""
    rows = []
    for endpoint in endpoints:
        prompt, completion = endpoint.usd_per_million()
        overrides = endpoint.pricing.overrides
        note = ""
        if overrides:
            conditions = [f"prompts >= {o.min_prompt_tokens} tokens" for o in overrides if o.min_prompt_tokens is not None]
            note = "overrides apply: " + ("; ".join(conditions) if conditions else "conditional prices")
        reason = _exclusion(endpoint, policy)
        rows.append(
            ProviderRow(
                provider=endpoint.provider_name,
                tag=endpoint.tag,
                declared_quantization=endpoint.declared_quantization,
                prompt_usd_per_m=round(prompt, 6),
                completion_usd_per_m=round(completion, 6),
                discount=endpoint.pricing.discount,
                price_note=note,
                status=endpoint.status,
                uptime_last_30m=endpoint.uptime_last_30m,
                context_length=endpoint.context_length,
                max_completion_tokens=endpoint.max_completion_tokens,
                supports_logprobs=endpoint.supports_logprobs,
                decision="excluded" if reason else CANDIDATE,
                reason=reason or CANDIDATE,
            )
        )
    return rows


@dataclass(frozen=True)
class Scenario:
    """The purchase priced at one candidate's rates."""

    scenario: str
    provider: str
    tag: str
    prompt_usd_per_m: float
    completion_usd_per_m: float
    output_cost_usd: float
    input_cost_usd: float
    total_cost_usd: float
    within_budget: bool
    affordable_output_tokens: int
    """What the budget buys at this completion price, before input-token cost."""
    affordable_output_tokens_per_dataset: int
    affordable_with_input_tokens: int
    """The same, counting ``input_tokens_per_output_token`` of prompt per output token."""


def price_scenario(name: str, row: ProviderRow, budget: PurchasePlan) -> Scenario:
    target = budget.datasets * budget.output_tokens_per_dataset
    output_cost = target * row.completion_usd_per_m / 1e6
    input_cost = target * budget.input_tokens_per_output_token * row.prompt_usd_per_m / 1e6
    per_output_token = row.completion_usd_per_m / 1e6
    with_input = per_output_token + budget.input_tokens_per_output_token * row.prompt_usd_per_m / 1e6
    affordable = int(budget.usd / per_output_token) if per_output_token > 0 else 0
    return Scenario(
        scenario=name,
        provider=row.provider,
        tag=row.tag,
        prompt_usd_per_m=row.prompt_usd_per_m,
        completion_usd_per_m=row.completion_usd_per_m,
        output_cost_usd=round(output_cost, 6),
        input_cost_usd=round(input_cost, 6),
        total_cost_usd=round(output_cost + input_cost, 6),
        within_budget=output_cost + input_cost <= budget.usd,
        affordable_output_tokens=affordable,
        affordable_output_tokens_per_dataset=affordable // budget.datasets,
        affordable_with_input_tokens=int(budget.usd / with_input) if with_input > 0 else 0,
    )


CONVENTION_PROBES = 2
"""First-round probes each logprob-mode provider is also asked at the generation's
temperature, for how it reports logprobs there (``probes.Design.convention_temperature``): one
reply reads clearly (its slope 1 raw, 1/T processed: 1.43 at T 0.7, the boundary 1.20; the
default roster's raw providers read 0.99–1.00, its coarse ones 0.66–0.80); two, in case one
fails."""


def probe_requests(row: ProviderRow, verify: Verify) -> int:
    """The most probe requests the verify stage sends one provider (every round it may take,
    and in logprob mode the ``CONVENTION_PROBES`` asked at the generation's temperature)."""
    p = verify.probes
    if row.supports_logprobs:
        return verify.max_probes_per_provider * p.completions_per_prompt + CONVENTION_PROBES
    return verify.max_probes_per_provider * p.sample_mode_completions_per_prompt


def probe_cost(row: ProviderRow, verify: Verify) -> float:
    """USD to audit one provider in the worst case (undecided until its last round)."""
    p = verify.probes
    per_request = p.mean_prompt_tokens * row.prompt_usd_per_m + p.max_tokens * row.completion_usd_per_m
    return probe_requests(row, verify) * per_request / 1e6


def plan_budget(rows: Sequence[ProviderRow], budget: PurchasePlan, verify: Verify) -> dict[str, Any]:
    """The budget plan: the purchase at the cheapest, median and worst candidate, what the
    budget affords, and what auditing every candidate costs."""
    candidates = sorted((r for r in rows if r.is_candidate), key=lambda r: (r.completion_usd_per_m, r.prompt_usd_per_m))
    scenarios: list[Scenario] = []
    if candidates:
        median = statistics.median_low([r.completion_usd_per_m for r in candidates])
        median_row = next(r for r in candidates if r.completion_usd_per_m == median)
        for name, row in (("cheapest", candidates[0]), ("median", median_row), ("worst", candidates[-1])):
            scenarios.append(price_scenario(name, row, budget))
    per_endpoint = {r.tag: round(probe_cost(r, verify), 6) for r in candidates}
    verification_cost = sum(per_endpoint.values())
    return {
        "budget_usd": budget.usd,
        "datasets": budget.datasets,
        "output_tokens_per_dataset": budget.output_tokens_per_dataset,
        "target_output_tokens": budget.datasets * budget.output_tokens_per_dataset,
        "input_tokens_per_output_token": budget.input_tokens_per_output_token,
        "candidates": len(candidates),
        "scenarios": [asdict(s) for s in scenarios],
        "verification": {
            "providers": len(candidates),
            "requests": sum(probe_requests(r, verify) for r in candidates),
            "worst_case": "every provider undecided until verify.max_probes_per_provider",
            "cost_usd": round(verification_cost, 6),
            "per_endpoint_usd": per_endpoint,
        },
        "budget_after_verification_usd": round(budget.usd - verification_cost, 6),
        "notes": [f"{r.tag}: {r.price_note}" for r in candidates if r.price_note],
    }


def _finite(text: str | None) -> float:
    value = float(text or "")
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


def _optional_int(text: str | None) -> int | None:
    return None if text in ("", "None", None) else int(text or "")


def _optional_float(text: str | None) -> float | None:
    return None if text in ("", "None", None) else _finite(text)


def providers_csv(rows: list[ProviderRow]) -> str:
    """``providers.csv``: a row per endpoint with the policy's decision (``read_providers`` reads it)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=PROVIDER_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(row.as_dict() for row in rows)
    return buffer.getvalue()


def read_providers(path: Path) -> list[ProviderRow]:
    """Read ``providers.csv`` back (the verify and generate stages use it); problems are
    one line naming the file and line."""

    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = set(PROVIDER_COLUMNS) - set(reader.fieldnames or [])
            if missing:
                raise ConfigError(f"{path}: missing columns {', '.join(sorted(missing))}; rerun the survey stage")
            rows = []
            for raw in reader:
                line = reader.line_num
                try:
                    rows.append(
                        ProviderRow(
                            provider=str(raw["provider"]),
                            tag=str(raw["tag"]),
                            declared_quantization=str(raw["declared_quantization"]),
                            prompt_usd_per_m=_finite(raw["prompt_usd_per_m"]),
                            completion_usd_per_m=_finite(raw["completion_usd_per_m"]),
                            discount=_finite(raw["discount"] or "0"),
                            price_note=str(raw["price_note"] or ""),
                            status=_optional_int(raw["status"]),
                            uptime_last_30m=_optional_float(raw["uptime_last_30m"]),
                            context_length=int(raw["context_length"] or ""),
                            max_completion_tokens=_optional_int(raw["max_completion_tokens"]),
                            supports_logprobs=raw["supports_logprobs"] == "True",
                            decision=str(raw["decision"]),
                            reason=str(raw["reason"]),
                        )
                    )
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(f"{path}:{line}: not a valid provider row") from None
            return rows
    except FileNotFoundError:
        raise ConfigError(f"{path}: providers table not found; run the survey stage first (quanthunt survey)") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read the providers table ({exc.__class__.__name__})") from None


def check_reasoning(mode: str, reasoning: ModelReasoning | None, model: str) -> None:
    """``reasoning.mode`` must fit the model the gateway describes: a reasoning model needs
    an explicit choice (off or on), and off only where thinking may be turned off. Raises
    ``ConfigError`` before anything is paid for."""
    if reasoning is None:
        if mode == "on":
            raise ConfigError(f"reasoning.mode: on, but the gateway lists no reasoning for {model}; set reasoning.mode: none")
        return
    if mode == "none":
        raise ConfigError(
            f"reasoning.mode: none, but {model} is a reasoning model (the gateway's /models lists its reasoning): "
            "set reasoning.mode to off (answers only) or on (reasoning verified and kept)"
        )
    if mode == "off" and reasoning.mandatory:
        raise ConfigError(f"reasoning.mode: off, but {model}'s reasoning is mandatory (it cannot be turned off): use on")
