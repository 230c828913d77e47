"""One calibrate run: each control deployment measured exactly as verify measures a provider
(the same prompts, settings and scoring at the reference), the margins and detection rates
``quanthunt.calibration`` bounds from them, and the file verify takes its margins from
(``applied``), which refuses a calibration made for another model or other settings (the
verdicts then carry the margins to generate's monitor and the report). ``stages/calibrate.py``
opens the targets and writes the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError
from rich.console import Console
from rich.table import Table

from quanthunt import calibration
from quanthunt.calibration import Bound, Faithful, Sampled
from quanthunt.config_files import read_text
from quanthunt.defaults import SANDBOX_MODEL
from quanthunt.errors import ConfigError
from quanthunt.gateway import GatewayError
from quanthunt.monitor import generation_settings, sampler_testable
from quanthunt.params import REFERENCE_CONTROL, SANDBOX, Decision, Margins, Params, Sampling, section_digest
from quanthunt.probes import Design, Probe, probe_seed
from quanthunt.reference import Reference
from quanthunt.verification import Scorer, thought_while_off, with_retries

CONTROL_SEED_OFFSET = 2
"""Control completions are seeded ``verify.seed + 2`` (providers' probes use the seed itself,
the reference's sample-mode baselines ``+ 1``): a control never replays a provider's draw."""

GENERATION_SEED_OFFSET = 3
"""Control completions at the generation's settings are seeded ``verify.seed + 3``."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Key(_Model):
    """What a calibration holds for. Verify refuses a calibration whose key differs from its
    own: margins measured at other settings, on another model or another server, or from
    other shipped values say nothing about this audit."""

    model: str
    """``survey.model``: the model bought."""
    reasoning: str
    """``reasoning.mode`` and, unless ``none``, its template arguments."""
    probes: dict[str, float | int]
    """The probe settings that shape what is measured: ``max_tokens``, ``temperature``, ``top_logprobs``."""
    shipped_sha256: str
    """Digest of ``verify.margin`` and ``verify.decision``: the values a calibration starts from."""
    calibrate: dict[str, object]
    """What was asked to be measured: ``calibrate``'s controls, coarse build, size and
    confidence (its concurrency aside). Changed since, the calibration is stale."""
    reference_model: str | None = None
    """The reference's model id and ``GET /version`` when it was measured; None when no
    control was (the shipped values stand)."""
    reference_server: str | None = None

    @classmethod
    def of(cls, params: Params) -> Key:
        r, p, v = params.reasoning, params.verify.probes, params.verify
        reasoning = r.mode if r.mode == "none" else f"{r.mode} {json.dumps(r.template_kwargs, sort_keys=True)}"
        shipped = hashlib.sha256((section_digest(v.margin) + section_digest(v.decision)).encode()).hexdigest()
        return cls(
            model=params.survey.model,
            reasoning=reasoning,
            probes={"max_tokens": p.max_tokens, "temperature": p.temperature, "top_logprobs": p.top_logprobs},
            shipped_sha256=shipped,
            calibrate=params.calibrate.model_dump(mode="json", exclude={"concurrency"}),
        )

    def differences(self, other: Key) -> list[str]:
        """Each setting (``probes.max_tokens``) where ``other`` differs, with both values; the
        reference's are checked once it answers (``check_reference``)."""
        exclude = {"reference_model", "reference_server"}
        mine, theirs = _flat(self.model_dump(exclude=exclude)), _flat(other.model_dump(exclude=exclude))
        names = [*mine, *(name for name in theirs if name not in mine)]
        return [f"{name} {theirs.get(name)!r} (now {mine.get(name)!r})" for name in names if theirs.get(name) != mine.get(name)]


def _flat(values: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in values.items():
        if isinstance(value, Mapping):
            out |= _flat(value, f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = value
    return out


class Measured(_Model):
    """What one deployment gave: completions measured and what failed, by kind."""

    name: str
    url: str
    """As ``calibrate.controls`` names it (a base URL carries no credentials: ``urls.check_base_url``)."""
    completions: int
    failed: dict[str, int]
    mean_abs_dlogprob: float
    extreme_share: float
    """Completions beyond the shipped ``tail_dlogprob``."""


class SamplerMeasured(_Model):
    """What one control gave at the generation's settings."""

    name: str
    completions: int
    failed: dict[str, int]
    extreme_share: float
    """Completions whose rank z is beyond ``sample_tail_z``."""
    mean_pit: float


class Generation(_Model):
    """The sampler margins the generate stage's monitor bets with, measured on the controls'
    completions at the generation's settings (``calibration.at_generation``)."""

    settings: dict[str, float | int]
    """``generate.sampling``'s ``temperature``, ``top_p`` and ``max_tokens`` it was measured
    at (``monitor.generation_settings``). Not part of the ``Key``: verify's margins do not
    depend on them, so a new generation temperature needs no new audit; generate refuses
    verdicts whose monitor margins were measured at other settings
    (``monitoring.monitor_margin``)."""
    controls: list[SamplerMeasured]
    margin: Margins
    """Verify's margins with ``sample_tail_p0`` and ``sampler_shift`` widened to the
    controls' bounds there: what the monitor bets against."""


class BoundRecord(_Model):
    control: str
    margin: str
    measured: float
    bound: float
    shipped: float
    used: float
    completions: int
    widened: bool


class CalibrationFile(_Model):
    """``paths.calibration``: what verify uses (its verdicts carry it on), and every figure behind it."""

    key: Key
    measured: bool
    """Whether any control was measured (else the shipped values stand, and say so)."""
    confidence: float
    controls: list[Measured]
    coarse: Measured | None
    margin: Margins
    decision: Decision
    bounds: list[BoundRecord]
    note: str
    generation: Generation | None = None
    """The monitor's sampler margins at the generation's settings; None where no control was
    measured there (the monitor then bets with ``margin``, and ``note`` says so)."""
    run_id: str = ""


def _records(control: str, bounds: Sequence[Bound]) -> list[BoundRecord]:
    return [BoundRecord(control=control, margin=b.margin, measured=b.measured, bound=b.bound, shipped=b.shipped, used=b.used,
                        completions=b.n, widened=b.widened) for b in bounds]  # fmt: skip


@dataclass
class Completions:
    """One deployment's measured completions (``Faithful``) and its failures."""

    faithful: Faithful
    failed: Counter[str]


async def measure(
    deployment: Reference,
    scorer: Scorer,
    design: Design,
    probes: Sequence[Probe],
    *,
    name: str,
    per_prompt: int,
    concurrency: int,
) -> Completions:
    """Every completion of ``probes`` × ``per_prompt`` sampled at ``deployment`` with the
    audit's settings and scored at the reference as verify scores a provider's: its mean
    |Δ logprob|, its rank z under the reference's top ``top_logprobs`` and under its top 20.
    A completion that gives nothing to measure is counted by why, never dropped silently."""
    failed: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    prompts: dict[str, list[int]] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(probe: Probe, index: int, seq: int) -> tuple[int, float, float, float, float, float] | None:
        async with gate:
            try:
                reply = await with_retries(
                    lambda: deployment.chat(probe.as_messages(), max_tokens=design.max_tokens,
                                            temperature=design.temperature, top_logprobs=design.top_logprobs,
                                            seed=probe_seed(design.seed + CONTROL_SEED_OFFSET, probe.id, index),
                                            template_kwargs=design.reasoning.reference_kwargs()),
                    attempts=design.max_attempts, errors=errors,
                )  # fmt: skip
                if not reply.logprobs:
                    failed["no_logprobs" if reply.content or reply.reasoning else "empty_completion"] += 1
                    return None
                if thought_while_off(design.reasoning, reply, errors):
                    failed["reasoning_not_off"] += 1
                    return None
                if probe.id not in prompts:
                    prompts[probe.id] = await scorer.prompt_ids(probe.as_messages(), errors)
                prompt = prompts[probe.id]
                ids = await scorer.completion_ids(reply.content, reply.reasoning, reply.finish_reason, errors)
                paired = await scorer.logprobs(prompt, reply, errors, probe_id=probe.id, index=index, seq=seq, ids=ids)
                text = await scorer.text(prompt, ids, errors, probe_id=probe.id, index=index, source=name, seq=seq)
            except GatewayError as exc:
                failed[exc.kind] += 1
                return None
            if not paired.deltas or not text.tokens:
                failed["unpaired_tokens"] += 1
                return None
            return seq, paired.mean_abs_delta, paired.rank_z, text.rank_z, paired.rank_pit, text.rank_pit

    jobs = [one(p, i, n * per_prompt + i) for n, p in enumerate(probes) for i in range(per_prompt)]
    done = sorted(r for r in await asyncio.gather(*jobs) if r is not None)
    faithful = Faithful(name, [r[1] for r in done], [r[2] for r in done], [r[3] for r in done],
                        [r[4] for r in done], [r[5] for r in done])  # fmt: skip
    return Completions(faithful, failed)


@dataclass
class SamplerCompletions:
    """One control's completions at the generation's settings (``Sampled``) and its failures."""

    sampled: Sampled
    failed: Counter[str]


async def measure_at_generation(
    deployment: Reference,
    scorer: Scorer,
    design: Design,
    sampling: Sampling,
    probes: Sequence[Probe],
    *,
    name: str,
    per_prompt: int,
    concurrency: int,
) -> SamplerCompletions:
    """Every completion of ``probes`` × ``per_prompt`` sampled at ``deployment`` at the
    generation's temperature (top-p 1), ranked at the reference as the generate stage's
    monitor ranks a reply (``scorer``: at that temperature, under the reference's top 20).
    The rank reads a text's first ``horizon`` tokens and its stop token within them, so a
    completion is asked for at most that many: what a longer generation budget adds is
    never read. A completion that gives nothing to rank is counted by why."""
    failed: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    prompts: dict[str, list[int]] = {}
    gate = asyncio.Semaphore(concurrency)
    max_tokens = min(sampling.max_tokens, scorer.horizon)

    async def one(probe: Probe, index: int, seq: int) -> tuple[int, float, float] | None:
        async with gate:
            try:
                reply = await with_retries(
                    lambda: deployment.chat(probe.as_messages(), max_tokens=max_tokens, temperature=sampling.temperature,
                                            top_logprobs=design.top_logprobs,
                                            seed=probe_seed(design.seed + GENERATION_SEED_OFFSET, probe.id, index),
                                            template_kwargs=design.reasoning.reference_kwargs()),
                    attempts=design.max_attempts, errors=errors,
                )  # fmt: skip
                if thought_while_off(design.reasoning, reply, errors):
                    failed["reasoning_not_off"] += 1
                    return None
                if probe.id not in prompts:
                    prompts[probe.id] = await scorer.prompt_ids(probe.as_messages(), errors)
                ids = await scorer.completion_ids(reply.content, reply.reasoning, reply.finish_reason, errors)
                text = await scorer.text(prompts[probe.id], ids, errors, probe_id=probe.id, index=index, source=name,
                                         seq=seq)  # fmt: skip
            except GatewayError as exc:
                failed[exc.kind] += 1
                return None
            if not text.tokens:
                failed["empty_completion"] += 1
                return None
            return seq, text.rank_z, text.rank_pit

    jobs = [one(p, i, n * per_prompt + i) for n, p in enumerate(probes) for i in range(per_prompt)]
    done = sorted(r for r in await asyncio.gather(*jobs) if r is not None)
    return SamplerCompletions(Sampled(name, [r[1] for r in done], [r[2] for r in done]), failed)


def summary(name: str, url: str, completions: Completions, margin: Margins) -> Measured:
    """What a deployment with at least one measured completion gave."""
    shifts = completions.faithful.shifts
    return Measured(
        name=name,
        url=url,
        completions=len(shifts),
        failed=dict(completions.failed),
        mean_abs_dlogprob=statistics.fmean(shifts),
        extreme_share=sum(s > margin.tail_dlogprob for s in shifts) / len(shifts),
    )


def calibrated(
    params: Params,
    key: Key,
    controls: Mapping[str, tuple[str, Completions]],
    coarse: tuple[str, Completions] | None,
    generation: Mapping[str, SamplerCompletions] | None = None,
) -> CalibrationFile:
    """The margins and detection rates ``controls`` and ``coarse`` establish, with every bound,
    and the monitor's sampler margins from the controls' completions at the generation's
    settings (``generation``, by control; none where the monitor does not test the sampler).

    Each control widens what the ones before it left (``calibration.calibrate`` never
    narrows), so the margins hold for a provider as noisy as the noisiest control. The
    bounds hold jointly at ``calibrate.confidence``: it is split evenly over the controls, the
    coarse build and each control at the generation's settings (Bonferroni), and within each
    as ``calibration`` splits it."""
    c = params.calibrate
    generation = generation or {}
    parts = len(controls) + (coarse is not None) + len(generation)
    each = 1 - (1 - c.confidence) / max(parts, 1)
    margin, decision = params.verify.margin, params.verify.decision
    records: list[BoundRecord] = []
    measured: list[Measured] = []
    for name, (url, completions) in controls.items():
        if not completions.faithful.shifts:
            raise ConfigError(f"calibrate.controls.{name}: no completion could be measured ({_failures(completions.failed)})")
        measured.append(summary(name, url, completions, params.verify.margin))
        try:
            margin, bounds = calibration.calibrate(margin, completions.faithful, confidence=each)
        except ValueError as exc:
            raise ConfigError(f"calibrate.controls.{name}: {exc} (calibrate.prompts × completions_per_prompt)") from None
        records += _records(name, bounds)
    coarse_measured = None
    if coarse is not None:
        url, completions = coarse
        if not completions.faithful.shifts:
            raise ConfigError(f"calibrate.coarse: no completion could be measured ({_failures(completions.failed)})")
        coarse_measured = summary("coarse", url, completions, params.verify.margin)
        try:
            decision, bounds = calibration.detection(decision, margin, completions.faithful, confidence=each)
        except ValueError as exc:
            raise ConfigError(f"calibrate.coarse: {exc}") from None
        records += _records("coarse", bounds)
    at_generation = None
    settings = generation_settings(params.generate.sampling)
    if generation and settings is not None:
        monitor_margin, sampled = margin, []
        for name, done in generation.items():
            z = done.sampled.z
            if not z:
                raise ConfigError(f"calibrate.controls.{name}: no completion at the generation's settings could be ranked "
                                  f"({_failures(done.failed)})")  # fmt: skip
            sampled.append(SamplerMeasured(name=name, completions=len(z), failed=dict(done.failed),
                                           extreme_share=sum(v > margin.sample_tail_z for v in z) / len(z),
                                           mean_pit=statistics.fmean(done.sampled.pit)))  # fmt: skip
            try:
                monitor_margin, bounds = calibration.at_generation(monitor_margin, done.sampled, confidence=each)
            except ValueError as exc:
                raise ConfigError(f"calibrate.controls.{name}: {exc}") from None
            records += _records(name, bounds)
        at_generation = Generation(settings=settings, controls=sampled, margin=monitor_margin)
    return CalibrationFile(
        key=key,
        measured=bool(controls or coarse),
        confidence=c.confidence,
        controls=measured,
        coarse=coarse_measured,
        margin=margin,
        decision=decision,
        bounds=records,
        note=_note(key, measured, coarse_measured, c.confidence, settings=settings, generation=at_generation),
        generation=at_generation,
    )


def _failures(failed: Mapping[str, int]) -> str:
    return ", ".join(f"{kind} ×{n}" for kind, n in sorted(failed.items(), key=lambda kv: -kv[1]))


def _note(key: Key, controls: Sequence[Measured], coarse: Measured | None, confidence: float, *,
          settings: Mapping[str, float | int] | None, generation: Generation | None) -> str:  # fmt: skip
    shipped = f"measured on {SANDBOX_MODEL} (the sandbox's pools: benchmarks/verify_power.py)"
    if controls:
        names = ", ".join(f"{m.name} ({m.completions} completions)" for m in controls)
        margins = (
            f"verify.margin is bounded at {confidence:.0%} confidence on faithful control deployments of {key.model}: "
            f"{names}; a shipped value is kept where the bound lies inside it"
        )
    else:
        margins = f"verify.margin is the shipped values, {shipped}: no control deployment of {key.model} was measured"
    if coarse is not None:
        rates = f"the mixture detection rates are the lower bounds measured on a coarse build ({coarse.completions} completions)"
    else:
        rates = f"the mixture detection rates are the shipped values, {shipped}: no coarse build was measured"
    if settings is None:
        return f"{margins}; {rates}"
    at = f"temperature {settings['temperature']:g}"
    if generation is not None:
        m = generation.margin
        monitor = (f"the monitor's sampler margins at the generation's {at} are bounded on the controls' completions "
                   f"there ({', '.join(f'{c.name} ({c.completions})' for c in generation.controls)}): sample_tail_p0 "
                   f"{m.sample_tail_p0:.3g}, sampler_shift {m.sampler_shift:.3g}")  # fmt: skip
    else:
        monitor = f"the monitor's sampler margins at the generation's {at} are verify's: no control was measured there"
    return f"{margins}; {rates}; {monitor}"


def shipped(params: Params) -> CalibrationFile:
    """What stands without a control or a coarse build: the shipped values, saying so."""
    return calibrated(params, Key.of(params), {}, None)


def load(path: Path) -> CalibrationFile:
    """``paths.calibration``, checked; a clear error naming the file otherwise."""
    text = read_text(path, what="calibration")
    try:
        return CalibrationFile.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(file)"
        raise ConfigError(
            f"{path}: not a calibration quanthunt wrote ({where}: {first['msg']}): run `quanthunt calibrate` again"
        ) from None


def applied(params: Params, root: Path) -> tuple[Params, CalibrationFile]:
    """``params`` with the calibration's margins and detection rates in ``verify``, and the
    calibration. Without the file and with nothing to calibrate on (a pipeline from before
    calibrate, or a stage run alone) the shipped values stand and the calibration says so.
    Raises ``ConfigError`` naming the file and every setting that differs when it was made
    for another model or settings, or when controls are named but were never measured."""
    path = root / params.paths.calibration
    if not path.exists():
        c = params.calibrate
        if c.controls or c.coarse is not None:
            raise ConfigError(f"{path}: not found, but calibrate names deployments to measure: run `quanthunt calibrate` "
                              "(dvc repro calibrate) first")  # fmt: skip
        return params, shipped(params)
    found = load(path)
    if differences := Key.of(params).differences(found.key):
        raise ConfigError(
            f"{path}: calibrated for other settings: {'; '.join(differences)}. Run `quanthunt calibrate` (dvc repro "
            "calibrate) again for these settings"
        )
    verify = params.verify.model_copy(update={"margin": found.margin, "decision": found.decision})
    return params.model_copy(update={"verify": verify}), found


def check_reference(calibration: CalibrationFile, *, model: str, server: str, path: Path) -> None:
    """Refuse a calibration measured against another reference (before anything is bought)."""
    key = calibration.key
    if key.reference_model is None:
        return
    if (key.reference_model, key.reference_server) != (model, server):
        raise ConfigError(
            f"{path}: calibrated against reference {key.reference_model} (server {key.reference_server}), but the "
            f"reference now serves {model} (server {server}). Run `quanthunt calibrate` again against this reference"
        )


def deployment_url(url: str, *, reference_url: str, sandbox_url: Callable[[str], str] | None) -> str:
    """The base URL a ``calibrate.controls`` value names."""
    if url == REFERENCE_CONTROL:
        return reference_url
    if url.startswith(f"{SANDBOX}:"):
        if sandbox_url is None:
            raise ConfigError(f"calibrate: {url} names a sandbox deployment, but neither api.base_url nor "
                              "reference.base_url is the sandbox")  # fmt: skip
        return sandbox_url(url.removeprefix(f"{SANDBOX}:"))
    return url


def plan_lines(params: Params) -> list[str]:
    """What the calibration will ask, printed before it starts."""
    c, p, sampling = params.calibrate, params.verify.probes, params.generate.sampling
    each = c.prompts * c.completions_per_prompt
    lines = [
        f"calibrate: {each} completions (≤ {p.max_tokens} tokens each) at each of {len(c.controls)} control(s)"
        + (" and the coarse build" if c.coarse else "")
        + f", each scored at the reference; {c.concurrency} in flight per deployment",
    ]
    if c.controls and sampler_testable(sampling):
        tokens = min(sampling.max_tokens, params.verify.decision.mixture_detection_tokens)
        lines.append(f"calibrate: and {each} completions (≤ {tokens} tokens each) at each control at the generation's "
                     f"temperature {sampling.temperature:g}, ranked as the monitor ranks them")  # fmt: skip
    return [*lines, "calibrate: controls are your own deployments: no dollars are spent (nothing goes through the gateway)"]


async def reach(deployment: Reference, model: str, *, field: str) -> None:
    """Fail fast, naming the control, when it cannot be reached or does not serve the
    reference's model under its name (every request then would fail the same way)."""
    try:
        served = await deployment.served_models()
    except GatewayError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    if model not in served:
        raise ConfigError(
            f"{field}: {deployment.base_url} serves {', '.join(served[:5])}, not the reference's model {model} "
            "(serve it under the same name, e.g. vLLM --served-model-name)"
        )


async def measure_all(
    params: Params,
    probes: Sequence[Probe],
    *,
    reference_url: str,
    sandbox_url: Callable[[str], str] | None,
    on_progress: Callable[[str], None] = lambda _: None,
) -> CalibrationFile:
    """Measure every control and the coarse build against the reference; the calibration."""
    c, design = params.calibrate, Design.of(params)
    urls = {name: deployment_url(url, reference_url=reference_url, sandbox_url=sandbox_url) for name, url in c.controls.items()}
    coarse_target = None if c.coarse is None else (c.coarse, deployment_url(c.coarse, reference_url=reference_url,
                                                                          sandbox_url=sandbox_url))  # fmt: skip
    async with Reference(reference_url, model=params.reference.model,
                         retry_for_s=params.verify.reference_retry_for_s) as reference:  # fmt: skip
        model = (await reference.check()).model
        server = await reference.server_version()
        scorer = Scorer(reference, params.reasoning, top_logprobs=design.top_logprobs, attempts=design.max_attempts,
                        horizon=design.rank_tokens)  # fmt: skip
        await scorer.check()

        @contextlib.asynccontextmanager
        async def opened(field: str, url: str) -> AsyncIterator[Reference]:
            if url == reference_url:
                yield reference
                return
            async with Reference(url, model=model) as deployment:
                await reach(deployment, model, field=field)
                yield deployment

        async def at(field: str, name: str, url: str) -> Completions:
            started = time.monotonic()
            async with opened(field, url) as deployment:
                done = await measure(deployment, scorer, design, probes, name=name, per_prompt=c.completions_per_prompt,
                                     concurrency=c.concurrency)  # fmt: skip
            failed = f" ({_failures(done.failed)} failed)" if done.failed else ""
            on_progress(f"calibrate: {name}: {len(done.faithful.shifts)} completions measured{failed} in "
                        f"{time.monotonic() - started:.0f} s")  # fmt: skip
            return done

        controls = {name: (c.controls[name], await at(f"calibrate.controls.{name}", name, url)) for name, url in urls.items()}
        coarse = None if coarse_target is None else (coarse_target[0], await at("calibrate.coarse", "coarse", coarse_target[1]))
        generation: dict[str, SamplerCompletions] = {}
        if sampler_testable(sampling := params.generate.sampling):
            ranker = Scorer(reference, params.reasoning, top_logprobs=design.top_logprobs, attempts=design.max_attempts,
                            horizon=design.rank_tokens, temperature=sampling.temperature)  # fmt: skip
            for name, url in urls.items():
                started = time.monotonic()
                async with opened(f"calibrate.controls.{name}", url) as deployment:
                    done = await measure_at_generation(deployment, ranker, design, sampling, probes, name=name,
                                                       per_prompt=c.completions_per_prompt,
                                                       concurrency=c.concurrency)  # fmt: skip
                generation[name] = done
                failed = f" ({_failures(done.failed)} failed)" if done.failed else ""
                on_progress(f"calibrate: {name} at temperature {sampling.temperature:g}: {len(done.sampled.z)} "
                            f"completions ranked{failed} in {time.monotonic() - started:.0f} s")  # fmt: skip
    key = Key.of(params).model_copy(update={"reference_model": model, "reference_server": server})
    return calibrated(params, key, controls, coarse, generation)


def metric_name(record: BoundRecord) -> str:
    """An MLflow-safe metric name: ``fp8-kv.sample_tail_p0.listed``."""
    return f"{record.control}.{record.margin}".replace(" (", ".").replace(")", "")


def show_calibration(calibration: CalibrationFile, console: Console) -> None:
    """What each control measured and the margins verify will use, with their bounds."""
    if calibration.controls or calibration.coarse is not None:
        measured = Table(title="Deployments measured", title_justify="left")
        for column in ("name", "url", "completions", "failed", "mean |Δ logprob|", "extreme share"):
            measured.add_column(column)
        for m in [*calibration.controls, *([calibration.coarse] if calibration.coarse is not None else [])]:
            failed = _failures(m.failed) or "0"
            measured.add_row(m.name, m.url, str(m.completions), failed, f"{m.mean_abs_dlogprob:.4f}", f"{m.extreme_share:.3f}")
        console.print(measured)
        bounds = Table(title=f"Bounds ({calibration.confidence:.0%} jointly)", title_justify="left")
        for column in ("from", "margin", "measured", "bound", "shipped", "used"):
            bounds.add_column(column)
        for b in calibration.bounds:
            bounds.add_row(b.control, b.margin, f"{b.measured:.4g}", f"{b.bound:.4g}", f"{b.shipped:.4g}",
                           f"[bold]{b.used:.4g}[/]" if b.widened else f"{b.used:.4g}")  # fmt: skip
        console.print(bounds)
    console.print(f"calibrate: {calibration.note}", soft_wrap=True)
