"""What the audit measures of each completion, and the arithmetic behind it. Pure: no I/O.

- **logprob mode** (the endpoint returns logprobs): the provider samples a completion with
  its top-k logprobs; the reference scores the same tokens teacher-forced
  (``compare_logprobs``). Per position: ``Δ = provider logprob − reference logprob`` of the
  sampled token, KL(reference ‖ provider) over the top-k union with a tail bucket, and
  top-1 agreement.
- **sample mode** (no logprobs): provider and reference each sample completions for the
  same prompts; the reference scores every completion (``SampledText``).

Every measured completion also gets its rank statistics (``rank``): the reference's
randomised PIT of each sampled token, its stop token included, as a normal score, summed
over a fixed horizon (a shorter text padded with independent draws) and divided by
√horizon: a rank z exactly N(0, 1) for text the reference's own sampler produced, at any
length, and its pit, the mean of Φ(z) given the text (mean exactly ½, less noisy). In
sample mode they are the measurement; in logprob mode they check the provider's sampler,
which the logprobs it reports say nothing about. ``Audit`` holds one provider's
measurements and accounts for every completion asked for; ``quanthunt.decision`` turns
audits into verdicts.
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from quanthunt import distances
from quanthunt.reference import PARTIAL, Position, Scored, canonical_name, merge_by_name
from quanthunt.replies import TokenLogprob
from quanthunt.verdicts import LogprobsReading, ProviderVerdict


@dataclass
class LogprobCompletion:
    """One audited completion in logprob mode."""

    probe_id: str
    index: int
    tokens: int
    aligned: int
    """Positions where the reference's tokenization of the text matches the provider's tokens
    (all of them unless the provider's tokenization is non-canonical; we stop at the first
    mismatch)."""
    deltas: list[float]
    kls: list[float]
    top1_agree: list[bool]
    rank_z: float = 0.0
    """The sampler check: rank z of the paired tokens under the reference's top-k."""
    rank_pit: float = 0.5
    """... and its ``Rank.pit``, which the sampler's mean tests bet on."""
    seq: int = 0
    """Position in the audit plan (probe order × completions + index): observations are
    tested in this order, so a later round never reorders an earlier one."""
    convention: Literal["raw", "processed"] = "raw"
    """How the provider's logprobs were read (``compare_logprobs``): ``raw``, the model's
    distribution before the sampler (vLLM's default ``--logprobs-mode raw_logprobs``, and the
    reference's echo always), or ``processed``, after temperature (``processed_logprobs``;
    some stacks always). At T 1 and top-p 1 the two are the same numbers."""
    slope: float | None = None
    """``logprob_slope`` of the paired positions (None: no alternative listed on both sides)."""

    @property
    def mean_abs_delta(self) -> float:
        return statistics.fmean(abs(d) for d in self.deltas) if self.deltas else 0.0


@dataclass
class SampledText:
    """A completion scored at the reference (sample mode)."""

    probe_id: str
    index: int
    source: str  # "provider" | "reference"
    token_ids: list[int]
    mean_loglik: float
    rank_z: float = 0.0
    """``Rank.z``: the sum over tokens (the stop token included, padded to a fixed horizon) of
    the normal score ``Φ⁻¹(u_t)`` of the token's randomised probability-integral transform
    under the reference, divided by √horizon (``u_t`` = the reference's mass on tokens it
    ranks above the sampled one, plus a uniform share of the token's own mass; uniform over
    the tail beyond the top-k). For text the reference samples itself every ``u_t`` is
    exactly uniform and independent of the past, so z is N(0, 1) with no calibration run;
    text from a coarser model or a hotter sampler picks tokens the reference ranks lower
    (z > 0), a colder or truncating sampler its favourites (z < 0)."""
    rank_pit: float = 0.5
    """Its ``Rank.pit``: E[Φ(z)] given the text, which the sampler's mean tests bet on."""
    tokens: int = 0
    seq: int = 0
    """Position in the audit plan (see ``LogprobCompletion.seq``)."""


@dataclass
class Audit:
    """Everything measured for one provider."""

    provider: str
    tag: str
    mode: str
    logprob: list[LogprobCompletion] = field(default_factory=list)
    sampled: list[SampledText] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    """Failed attempts by kind (a retried request that then succeeded counts too)."""
    failed: int = 0
    """Completions asked for that gave nothing to measure (the sum of ``unusable``)."""
    unusable: Counter[str] = field(default_factory=Counter)
    """Each completion asked for and not measured, once, by why: the last error's kind
    (``timeout``, ``http_503``, ...), ``no_logprobs``, ``empty_completion``,
    ``unpaired_tokens``, ``reasoning_not_off``, ``unscored_tokens``. With the measured ones
    they add up to ``attempted``."""
    possibly_billed: int = 0
    """Requests that timed out after they were sent: the provider may have generated and
    billed them (their cost is not in ``cost_usd``)."""
    served_by: Counter[str] = field(default_factory=Counter)
    cost_usd: float = 0.0
    """What the replies measured cost, those an earlier run bought included."""
    reused: int = 0
    """Replies an earlier run bought with the same request, used again (``quanthunt.paid_replies``)."""
    reused_cost_usd: float = 0.0
    """Their part of ``cost_usd``: paid before this run."""
    tokens: int = 0
    attempted: int = 0
    first_round_end: int = 0
    """Completions with ``seq`` below this came from the first round (the fixed-sample
    baselines' sample)."""
    convention_temperature: float | None = None
    """Logprob mode: the generation's temperature, where ``convention`` was asked (None: not asked)."""
    convention: list[LogprobCompletion] = field(default_factory=list)
    """Replies sampled at ``convention_temperature`` and read for their logprob convention
    only (``LogprobCompletion.convention``): not measurements of the audit's tests."""
    convention_asked: int = 0
    """Requests sent for ``convention`` (a failed one is left unread)."""

    def unusable_completion(self, reason: str) -> None:
        """A completion asked for that gives nothing to measure: counted, never dropped."""
        self.failed += 1
        self.unusable[reason] += 1


RANK_TOP_K = 20
"""Top logprobs asked of the reference when scoring sample-mode texts (the rank statistic)."""

_STANDARD_NORMAL = statistics.NormalDist()
"""Per-token quantiles: the stdlib's is ~1,000x faster than scipy's on scalars, equal to 1e-15."""


def pit_normal_score(position: Position, *, listed: int, u: float) -> float:
    """``Φ⁻¹`` of the randomised PIT of one token (see ``SampledText.rank_z``).

    ``position`` holds the reference's top-``listed`` alternatives, with or without the
    scored token (vLLM adds it, SGLang does not): membership in the top is decided by value
    (``Position.in_top``), never by the list's length. ``u`` is a uniform draw in [0, 1)."""
    p = math.exp(position.logprob)
    others = position.outranked_by()
    if position.in_top(listed):
        above = sum(math.exp(v) for v in others if v > position.logprob)
        ties = sum(math.exp(v) for v in others if v == position.logprob)
        value = above + u * (p + ties)
    else:
        listed_mass = min(sum(math.exp(v) for v in others[:listed]), 1.0)
        value = listed_mass + u * (1.0 - listed_mass)
    return _normal_score(value)


def _normal_score(value: float) -> float:
    return _STANDARD_NORMAL.inv_cdf(min(max(value, 1e-12), 1 - 1e-12))


def tempered_pit_normal_score(position: Position, *, listed: int, u: float, temperature: float) -> float:
    """``Φ⁻¹`` of the token's randomised PIT for a text sampled at ``temperature`` in (0, 1),
    from ``q(x) ∝ p(x)^(1/T)``, given which of the reference's top ``listed`` it is.

    Tempering needs the normaliser ``Σ p^(1/T)`` over the whole vocabulary, and the
    reference lists only its top tokens: the unlisted ones' tempered mass is known only to
    lie between 0 and ``M · b^(1/T − 1)`` (``M`` their raw mass, ``b`` the last listed
    probability). Bounding the PIT by those ends was measured too loose to use (SmolLM2's
    own samples at T 0.7 scored by its top 20: mean pit between 0.454 and 0.572, the
    bounds 0.066 apart at the median). Within the top, though, ``q`` given that the token
    is one of them is known exactly (the normaliser cancels), so the PIT is taken given
    that: exactly uniform, given everything before, for a sampler at ``temperature``. A
    token outside the top scores ``u`` itself, a draw apart from the text (uniform too),
    so the sum stays exactly N(0, 1) whatever the tail holds; the statistic then reads the
    order within the top, which is where a hotter or coarser sampler shows."""
    if not 0.0 < temperature < 1.0:
        raise ValueError(f"the tempered PIT needs a temperature in (0, 1), got {temperature}")
    if not position.in_top(listed):
        return _normal_score(u)
    power = 1.0 / temperature
    own = position.logprob
    top = sorted([own, *position.outranked_by()], reverse=True)[:listed]
    top.remove(own)
    above = math.fsum(math.exp(power * (v - own)) for v in top if v > own)
    ties = top.count(own)
    mass = math.fsum(math.exp(power * (v - own)) for v in top) + 1.0  # the top's tempered mass, in units of the token's
    return _normal_score((above + u * (1 + ties)) / mass)


@dataclass(frozen=True)
class Rank:
    """A completion's rank statistics (``rank``): ``S``, the sum of the normal scores of its
    first ``horizon`` tokens (the stop token among them when it stopped), over ``n`` of them."""

    z: float
    """``(S + P) / √horizon`` with ``P`` an independent N(0, horizon − n) draw (seeded): the
    padding a shorter text gets. Exactly N(0, 1) for the reference's own sampler, at any
    length: each token's score is N(0, 1) given everything before it, and once the text
    ends, by its stop token or at ``horizon``, the rest are drawn apart from it, so there
    are always ``horizon`` i.i.d. N(0, 1) terms. Its tail (``z > sample_tail_z``) flags a
    completion at exactly ``1 − Φ(sample_tail_z)`` then."""
    pit: float
    """``E[Φ(z) | the text] = Φ(S / √(2·horizon − n))``: the padding averaged out, so its
    mean is exactly ½ too, at a fraction of ``Φ(z)``'s variance for a short text (a third
    at 30 tokens of 64); the sampler's mean tests bet on it."""


def rank(positions: Sequence[Position], *, listed: int, seed: str, horizon: int, temperature: float = 1.0) -> Rank:
    """A completion's rank statistics (see ``Rank``; seeded: the same text gives the same),
    for a text sampled at ``temperature`` in (0, 1] (``tempered_pit_normal_score`` below 1).

    Dividing by √tokens and leaving the stop token out, as before, let the length the text
    chose weigh its own tokens: a simulated exact sampler's texts (5–64 tokens, median 11)
    had mean Φ(z) 0.525 (``tests/test_measurements.py``)."""
    if horizon < 1:
        raise ValueError(f"horizon must be at least 1, got {horizon}")
    rng = np.random.default_rng(int(hashlib.sha256(seed.encode()).hexdigest()[:16], 16))
    kept = positions[:horizon]
    score = functools.partial(pit_normal_score, listed=listed)
    if temperature != 1.0:
        score = functools.partial(tempered_pit_normal_score, listed=listed, temperature=temperature)
    total = math.fsum(score(position, u=float(rng.random())) for position in kept)
    padding = math.sqrt(horizon - len(kept)) * float(rng.standard_normal())
    pit = _STANDARD_NORMAL.cdf(total / math.sqrt(2 * horizon - len(kept)))
    return Rank((total + padding) / math.sqrt(horizon), pit)


def logprob_slope(provider_gaps: Sequence[float], reference_gaps: Sequence[float]) -> float | None:
    """The least-squares slope through the origin of the provider's within-position logprob
    gaps (an alternative's logprob minus the sampled token's, at the same position) on the
    reference's gaps for the same tokens: 1 for raw logprobs, ``1/T`` for logprobs after
    temperature ``T`` (the normaliser cancels in a gap, so no unlisted mass enters). None
    without a gap."""
    scale = math.fsum(r * r for r in reference_gaps)
    if scale == 0.0:
        return None
    return math.fsum(p * r for p, r in zip(provider_gaps, reference_gaps, strict=True)) / scale


def reads_processed(slope: float | None, temperature: float | None) -> bool:
    """Whether logprobs whose ``logprob_slope`` is ``slope`` are after temperature: nearer
    ``1/T`` than 1 on a log scale (at T 0.7 the two are 1 and 1.43, the boundary 1.20). Only
    for 0 < T < 1 (``processed_at``); otherwise never."""
    if slope is None or temperature is None or not 0.0 < temperature < 1.0:
        return False
    return slope > 1.0 / math.sqrt(temperature)


def tempered_logprob_bounds(position: Position, temperature: float) -> tuple[float, float]:
    """Bounds on the reference's logprob of its scored token after temperature ``T`` in
    (0, 1): ``log p^(1/T) − log Z`` with ``Z = Σ p_v^(1/T)`` over the whole vocabulary. The
    listed tokens give ``Z``'s lower end; each unlisted token is no likelier than the least
    likely listed alternative (``b``) and they hold the raw mass ``M`` left over, so their
    tempered mass is at most ``M · b^(1/T − 1)``, the upper end. Exact when the list
    holds all the mass."""
    if not 0.0 < temperature < 1.0:
        raise ValueError(f"tempered logprobs need a temperature in (0, 1), got {temperature}")
    power = 1.0 / temperature
    others = position.outranked_by()
    listed = [position.logprob, *others]
    log_listed = float(np.logaddexp.reduce(np.array(listed) * power))
    unlisted = max(0.0, 1.0 - math.fsum(math.exp(v) for v in listed))
    if unlisted == 0.0:
        log_all = log_listed
    else:
        least = min(others) if others else 0.0
        log_all = float(np.logaddexp(log_listed, math.log(unlisted) + (power - 1.0) * least))
    own = power * position.logprob
    return own - log_all, own - log_listed


def _nearest_zero(low: float, high: float) -> float:
    return low if low > 0.0 else high if high < 0.0 else 0.0


def logprobs_reading(audit: Audit) -> LogprobsReading | None:
    """How ``audit``'s convention replies read (None where none were asked)."""
    if audit.convention_temperature is None:
        return None
    read = {c.convention for c in audit.convention}
    read_as = "unread" if not read else read.pop() if len(read) == 1 else "mixed"
    slopes = [round(c.slope, 4) for c in audit.convention if c.slope is not None]
    return LogprobsReading(temperature=audit.convention_temperature, read_as=read_as, slopes=slopes,
                           replies=len(audit.convention), asked=audit.convention_asked)  # fmt: skip


def names_pair(provider: str, reference: str) -> bool:
    """Whether a provider's token and the reference's re-tokenization may be the same token
    at a position: the same decoded text, or a partial UTF-8 piece on either side (its text
    is empty). ``compare_logprobs`` then checks the text both sides have named agrees."""
    provider, reference = canonical_name(provider), canonical_name(reference)
    return provider == reference or PARTIAL in (provider, reference)


def compare_logprobs(
    probe_id: str,
    index: int,
    provider: Sequence[TokenLogprob],
    scored: Scored,
    prompt_len: int,
    *,
    listed: int,
    horizon: int,
    stopped: bool = False,
    temperature: float = 1.0,
    processed_at: float | None = None,
    seq: int = 0,
) -> LogprobCompletion:
    """Pair the provider's tokens with the reference's teacher-forced scores, position by
    position, up to the first position where the two tokenizations disagree. A partial
    UTF-8 piece pairs with anything, but only pairs up to the last position where both
    sides had named the same text count: a provider that sampled a character in other
    pieces than the reference's re-tokenization would otherwise be compared position by
    position with the wrong tokens (measured: a faithful reply came out extreme).

    Per position both sides list the sampled token and the same number of alternatives
    besides it (vLLM's chat lists only the top k−1 when the sampled token is outside the
    top k; its echo lists k), compared by decoded name in context and merged alike
    (``merge_by_name``), so a provider identical to the reference has KL exactly 0.

    ``scored`` ends with the stop token where the reply ``stopped``; vLLM lists it last among
    the provider's tokens and it pairs like any other. A provider that leaves it out still
    sampled it: its rank z scores it after a pairing that reached the end.

    ``processed_at``: the temperature in (0, 1) the reply was sampled at with top-p 1, where
    a provider may report its logprobs after temperature (``LogprobCompletion.convention``;
    the reference's are raw). The reply is read in the convention its ``logprob_slope`` points
    to; read as processed, each Δ is taken against the reference's tempered logprob at the
    end of its bounds (``tempered_logprob_bounds``) nearest the provider's, so it is never
    larger than the true Δ: a faithful provider is not made to look coarse by the unlisted
    mass. ``temperature`` is the one the rank statistics read (``rank``)."""
    paired: list[Position] = []
    pairs: list[tuple[float, Position, dict[str, float], int]] = []  # provider logprob, position, provider top, depth
    gaps: list[tuple[float, float]] = []  # (provider, reference) logprob gaps of an alternative to the sampled token
    gaps_after: list[int] = []  # len(gaps) after each pair
    said = heard = ""  # the text the provider's and the reference's tokens have named so far
    synced = 0  # pairs up to the last position both sides named whole, with the same text
    for token, position in zip(provider, scored.positions[prompt_len:], strict=False):
        names = position.names if position is not None else None
        if position is None or names is None or not names_pair(token.token, names[position.key]):
            break
        own, heard_own = canonical_name(token.token), canonical_name(names[position.key])
        said += own
        heard += heard_own
        if PARTIAL not in (own, heard_own):
            if said != heard:  # a piece paired with a whole token: the tokenizations parted before here
                break
            synced = len(pairs) + 1
        paired.append(position)
        shown = [(t.token, t.logprob) for t in token.top_logprobs]
        sampled = (token.token, token.logprob)
        alternatives = [t for t in shown if t != sampled] if sampled in shown else shown[: max(len(shown) - 1, 0)]
        provider_top = merge_by_name([sampled, *alternatives])
        pairs.append((token.logprob, position, provider_top, len(alternatives)))
        if PARTIAL not in (own, heard_own):
            reference_all = merge_by_name([(names[k], v) for k, v in position.others()])
            for name, value in provider_top.items():
                if name not in (own, PARTIAL) and name in reference_all:
                    gaps.append((value - provider_top[own], reference_all[name] - position.logprob))
        gaps_after.append(len(gaps))
    if said != heard or len(pairs) > synced:  # pieces at the end that never came back in step
        del pairs[synced:], paired[synced:], gaps[gaps_after[synced - 1] if synced else 0 :]
    slope = logprob_slope([g[0] for g in gaps], [g[1] for g in gaps])
    processed = reads_processed(slope, processed_at)
    deltas: list[float] = []
    kls: list[float] = []
    agree: list[bool] = []
    for logprob, position, provider_top, depth in pairs:
        names = position.names
        assert names is not None
        shift = 0.0  # log of the tempered normaliser, less the raw one's (0)
        power = 1.0
        if processed and processed_at is not None:
            low, high = tempered_logprob_bounds(position, processed_at)
            deltas.append(_nearest_zero(logprob - high, logprob - low))
            power = 1.0 / processed_at
            shift = power * position.logprob - min(max(logprob, low), high)
        else:
            deltas.append(logprob - position.logprob)
        reference_top = merge_by_name(
            [(names[position.key], power * position.logprob - shift),
             *((names[k], power * v - shift) for k, v in position.others()[:depth])]
        )  # fmt: skip
        kls.append(distances.kl_topk_with_tail(reference_top, provider_top))
        agree.append(max(provider_top, key=provider_top.__getitem__) == max(reference_top, key=reference_top.__getitem__))
    ranked = paired
    rest = scored.positions[prompt_len + len(paired) :]
    if stopped and len(paired) == len(provider) and len(rest) == 1 and rest[0] is not None:
        ranked = [*paired, rest[0]]
    ranks = rank(ranked, listed=listed, seed=f"{probe_id}:{index}:provider:{[p.token_id for p in ranked]}", horizon=horizon,
                 temperature=temperature)  # fmt: skip
    return LogprobCompletion(probe_id, index, len(provider), len(deltas), deltas, kls, agree, ranks.z, ranks.pit, seq,
                             "processed" if processed else "raw", slope)  # fmt: skip


def accounted(verdict: ProviderVerdict, audit: Audit) -> ProviderVerdict:
    """``verdict`` with its audit's accounting: every completion it could not use, by why,
    the requests that timed out after they were sent (possibly billed), the replies an
    earlier run had bought, and how its logprobs read at the generation's temperature."""
    return verdict.model_copy(
        update={
            "unusable": dict(audit.unusable),
            "possibly_billed": audit.possibly_billed,
            "reused_replies": audit.reused,
            "reused_cost_usd": round(audit.reused_cost_usd, 8),
            "logprobs_reading": logprobs_reading(audit),
        }
    )


def summary_values(audit: Audit) -> dict[str, Any]:
    """Per-provider raw series for plots: per-token Δ (logprob mode) or per-completion
    rank z by source (sample mode)."""
    if audit.mode == "logprob":
        return {
            "deltas": [d for c in audit.logprob for d in c.deltas],
            "completion_means": [c.mean_abs_delta for c in audit.logprob],
        }
    return {
        "provider": [s.rank_z for s in audit.sampled if s.source == "provider"],
        "reference": [s.rank_z for s in audit.sampled if s.source == "reference"],
    }
