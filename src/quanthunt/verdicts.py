"""``reports/verify/verdicts.json``: the verification stage's decisions, the contract the
generate and validate stages read. Validated on write and on read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quanthunt.config_files import field_path, one_line
from quanthunt.defaults import SANDBOX_MODEL
from quanthunt.errors import ConfigError
from quanthunt.params import Decision, Margins

Verdict = Literal["equivalent", "different", "inconclusive"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Estimate(_Model):
    """An effect size with its 95 % confidence interval."""

    value: float
    ci_low: float
    ci_high: float


class TestResult(_Model):
    """One hypothesis test as run for one provider."""

    name: str
    kind: Literal["difference", "equivalence", "baseline"]
    """``difference`` tests can make a provider ``different``; ``equivalence`` tests are needed
    for ``equivalent``; ``baseline`` tests are reported for comparison and decide nothing."""
    statistic: float
    p_value: float
    p_adjusted: float | None
    null: str


class Observed(_Model):
    """The audit's betting observations in audit order, from which the generate stage's
    monitor continues the e-process (``quanthunt.monitor``)."""

    shift: list[float]
    """Logprob mode: mean |Δ logprob| per completion (empty in sample mode)."""
    z: list[float]
    """Rank z per completion."""
    pit: list[float] = []
    """Its mean Φ given the text (``measurements.Rank.pit``), what the sampler's mean tests
    bet on; empty in a file from before it was kept (the monitor then bets on Φ(z))."""


class LogprobsReading(_Model):
    """How a logprob-mode provider's logprobs read at the generation's temperature, which
    the audit's own probes, at T 1, cannot tell: ``raw`` (the model's distribution, as the
    reference's) or ``processed`` (after temperature, vLLM's ``processed_logprobs``), by the
    slope of its within-position gaps on the reference's (``measurements.logprob_slope``:
    1 raw, 1/T processed), over ``replies`` probe replies sampled at ``temperature``, of
    ``asked`` requests (paid, counted in ``served_by`` and ``cost_usd`` like the audit's).
    ``mixed``: replies of both; ``unread``: no reply could be read."""

    temperature: float
    read_as: Literal["raw", "processed", "mixed", "unread"]
    slopes: list[float]
    replies: int = Field(ge=0)
    asked: int = Field(ge=0)


class ProviderVerdict(_Model):
    provider: str
    tag: str
    declared_quantization: str
    survey_decision: str
    """The survey's reason (``candidate``, ``excluded: declared nvfp4``, ...)."""
    eligible: bool
    """Candidate in the survey *and* ``equivalent`` here: may serve training records."""
    mode: Literal["logprob", "sample"]
    verdict: Verdict
    reason: str
    tests: list[TestResult]
    effects: dict[str, Estimate]
    power: dict[str, float]
    probes_needed: int | None
    """When inconclusive: about how many more completions the verdict would need."""
    probes: int = Field(ge=0)
    completions: int = Field(ge=0)
    rounds: int = Field(default=1, ge=0)
    """Audit rounds this provider took part in (decided providers stop early)."""
    e_value: float = Field(default=1.0, ge=0)
    """The largest wealth the provider's combined difference e-process reached."""
    e_path: list[float] = Field(default_factory=list)
    """That e-process after each completion, in audit order (for the report's plot)."""
    observed: Observed = Observed(shift=[], z=[])
    failed_requests: int = Field(ge=0)
    """Completions asked for that gave nothing to measure (the sum of ``unusable``)."""
    unusable: dict[str, int] = Field(default_factory=dict)
    """Each of them once, by why (``timeout``, ``no_logprobs``, ``empty_completion``,
    ``unpaired_tokens``, ...): with ``completions`` they add up to every completion asked for."""
    possibly_billed: int = Field(default=0, ge=0)
    """Requests that timed out after they were sent (and were retried): the provider may
    have generated and billed them; their cost is not in ``cost_usd``."""
    errors: dict[str, int]
    """Failed attempts by kind, retried ones included."""
    tokens: int = Field(ge=0)
    served_by: dict[str, int]
    """Serving providers the responses named; anything but this provider is flagged."""
    cost_usd: float = Field(ge=0)
    """What the replies measured cost, ``reused_cost_usd`` of it paid by an earlier run."""
    reused_replies: int = Field(default=0, ge=0)
    """Replies an earlier run bought with the same request, used again
    (``quanthunt.paid_replies``)."""
    reused_cost_usd: float = Field(default=0, ge=0)
    logprobs_reading: LogprobsReading | None = None
    """Logprob mode, generated at a temperature in (0, 1) with top-p 1: how its logprobs read
    there (None: not asked, e.g. at generation T 1 where the two conventions agree)."""
    mlflow_run_id: str | None = None

    def unusable_text(self) -> str:
        """``no_logprobs ×3, timeout ×1`` (empty when every completion was measured)."""
        return ", ".join(f"{k} ×{n}" for k, n in sorted(self.unusable.items(), key=lambda kv: (-kv[1], kv[0])))

    def measured_precision(self, margin: Margins) -> str:
        """The precision measured, named by its effects against their margins, e.g.
        ``equivalent: mean |Δlogprob| 0.012 (CI ≤ 0.03) < margin 0.08; sampler: mean Φ(rank z)
        0.49 (CI 0.41–0.57) within ½ ± 0.15``. The intervals are the confidence sequences the
        sequential tests bet on (valid however many rounds were looked at)."""
        parts = []
        if (shift := self.effects.get("mean_abs_dlogprob_clipped")) is not None:
            m, what = margin.mean_abs_dlogprob, f"mean |Δlogprob| {shift.value:.3g}"
            if shift.ci_high < m:
                parts.append(f"{what} (CI ≤ {shift.ci_high:.3g}) < margin {m:g}")
            elif shift.ci_low > m:
                parts.append(f"{what} (CI ≥ {shift.ci_low:.3g}) > margin {m:g}")
            else:
                parts.append(f"{what} (CI {shift.ci_low:.3g}–{shift.ci_high:.3g}) vs margin {m:g}")
        if (pit := self.effects.get("mean_pit")) is not None:
            what = f"sampler: mean Φ(rank z) {pit.value:.3g} (CI {pit.ci_low:.3g}–{pit.ci_high:.3g})"
            eq, shifted = margin.sampler_equivalence, margin.sampler_shift
            if 0.5 - eq < pit.ci_low and pit.ci_high < 0.5 + eq:
                parts.append(f"{what} within ½ ± {eq:g}")
            elif pit.ci_low > 0.5 + shifted or pit.ci_high < 0.5 - shifted:
                parts.append(f"{what} off ½ by more than {shifted:g}")
            else:
                parts.append(f"{what} vs ½ ± {eq:g}")
        return f"{self.verdict}: " + ("; ".join(parts) if parts else "nothing measured")


class Calibration(_Model):
    """What the margins and mixture detection rates the verdicts rest on were measured on.

    The shipped values were measured on the sandbox's SmolLM2-135M-Instruct only; a team's
    own model (Kimi K2.5 on their GPUs) has other faithful noise, and until quanthunt can
    calibrate on their deployment, every verdict on another model says so rather than
    passing its error rates and power off as measured (issue 25)."""

    measured_on: str
    """The model the shipped values were measured on."""
    model: str
    """The model audited."""
    measured_for_model: bool
    note: str
    margin: Margins | None = None
    """The margins verify decided with (the generate stage's monitor bets against the same);
    None in a file from before they were recorded."""
    decision: Decision | None = None
    """The detection rates and the rest of ``verify.decision`` it decided with."""
    monitor_margin: Margins | None = None
    """The margins the generate stage's monitor bets with: ``margin`` with the sampler's
    widened to what the controls showed at the generation's settings
    (``calibration.at_generation``); None: ``margin`` (no control was measured there)."""
    monitor_settings: dict[str, float | int] | None = None
    """The generation settings ``monitor_margin`` was measured at (``temperature``,
    ``top_p``, ``max_tokens``)."""

    @classmethod
    def of(
        cls,
        model: str,
        *,
        controls: Sequence[str] = (),
        note: str = "",
        margin: Margins | None = None,
        decision: Decision | None = None,
        monitor_margin: Margins | None = None,
        monitor_settings: dict[str, float | int] | None = None,
    ) -> Calibration:
        """``controls``: the deployments ``calibrate`` measured the margins on, with its ``note``
        (also given when only a coarse build was measured); none: the shipped margins,
        measured on the sandbox's model only. ``margin``, ``decision``: what verify used;
        ``monitor_margin``: the monitor's, measured at ``monitor_settings``."""
        if controls:
            return cls(measured_on=f"control deployments of {model}: {', '.join(controls)}", model=model,
                       measured_for_model=True, note=note, margin=margin, decision=decision,
                       monitor_margin=monitor_margin, monitor_settings=monitor_settings)  # fmt: skip
        measured = model.lower() == SANDBOX_MODEL
        if not note and measured:
            note = (
                f"the shipped verify.margin and mixture detection rates were measured on this model ({SANDBOX_MODEL}, "
                "the sandbox's pools: benchmarks/verify_power.py)"
            )
        elif not note:
            note = (
                f"verify.margin and the mixture detection rates are not measured for {model}: the shipped values were "
                f"measured on {SANDBOX_MODEL} (the sandbox's pools: benchmarks/verify_power.py), and a faithful "
                f"deployment of {model} may have other noise, so the error rates and the mixture power printed are "
                "assumed for it, not established (name control deployments in calibrate.controls and run "
                "`quanthunt calibrate` to measure them)"
            )
        return cls(measured_on=SANDBOX_MODEL, model=model, measured_for_model=measured, note=note, margin=margin,
                   decision=decision)  # fmt: skip


class Verdicts(_Model):
    """The whole file."""

    model: str
    reference_model: str
    created_at: str
    params_sha256: str
    alpha: float
    correction: Literal["holm", "bh"]
    probe_ids: list[str]
    verification_run_id: str | None
    cost_usd: float = Field(ge=0)
    """What the audit's replies cost, ``reused_cost_usd`` of it paid by earlier runs."""
    reused_cost_usd: float = Field(default=0, ge=0)
    calibration: Calibration | None = None
    """What the margins and detection rates were measured on (None: a file from before it was recorded)."""
    providers: list[ProviderVerdict]

    def eligible(self) -> list[ProviderVerdict]:
        return [p for p in self.providers if p.eligible]

    def margin_or(self, configured: Margins) -> Margins:
        """The margins verify decided with; ``configured`` for a file from before they were recorded."""
        return self.calibration.margin if self.calibration is not None and self.calibration.margin else configured

    def decision_or(self, configured: Decision) -> Decision:
        """The decision settings verify decided with; ``configured`` for a file from before they were recorded."""
        return self.calibration.decision if self.calibration is not None and self.calibration.decision else configured


def load_verdicts(path: Path) -> Verdicts:
    """Read and validate ``verdicts.json``; problems are one line naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: verdicts file not found; run the verify stage first (quanthunt verify)") from None
    except (OSError, ValueError) as exc:  # a directory, not UTF-8, ...
        raise ConfigError(f"{path}: cannot read verdicts ({exc.__class__.__name__})") from None
    try:
        return Verdicts.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid verdicts (nested too deeply)") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{path}: {field_path(first['loc'])}: {one_line(first['msg'], 300)}") from None
