"""The generate stage's monitors at work: which production requests are monitored, their
replies scored at the reference in the background (never on the request's path), the
state saved to the ledger, and a provider stopped when its monitor crosses.

The statistics are :mod:`quanthunt.monitor`'s; this module is the I/O around them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quanthunt.errors import ConfigError
from quanthunt.gateway import GatewayError
from quanthunt.ledger import Ledger, LedgerWriter, RequestKey, SaveMonitor
from quanthunt.monitor import Observation, ProviderMonitor, Stop, generation_settings, sampler_testable
from quanthunt.params import Margins, Sampling
from quanthunt.params import Monitor as MonitorParams
from quanthunt.reference import Reference
from quanthunt.replies import ChatReply
from quanthunt.verdicts import Verdicts
from quanthunt.verification import Scorer, thought_while_off

UNLOGGED = "unlogged"
"""The verification run id of verdicts written without MLflow (monitor states key on it)."""

LOGPROB_TOP = 5
"""Top logprobs a monitored logprob-mode request asks for (as the verify stage's probes)."""


def stopped_providers(ledger: Ledger, verdicts: Verdicts) -> dict[str, str]:
    """Tag → the dataset whose monitor stopped the provider, for this verification: such a
    provider gets no more requests (for any dataset) until verify runs again."""
    saved = ledger.monitor_states(verdicts.verification_run_id or UNLOGGED)
    return {tag: dataset for (dataset, tag), state in sorted(saved.items()) if state["stopped"] is not None}


def monitor_margin(verdicts: Verdicts, sampling: Sampling, configured: Margins) -> Margins:
    """The margins the monitors bet against: verify's, with the sampler's widened to what the
    calibration measured at the generation's settings (``Calibration.monitor_margin``).
    Raises ``ConfigError`` when those were measured at other generation settings."""
    c = verdicts.calibration
    if c is None or c.monitor_margin is None:
        return verdicts.margin_or(configured)
    now, then = generation_settings(sampling) or {}, c.monitor_settings or {}
    if differ := [f"generate.sampling.{k} {then.get(k)!r} (now {v!r})" for k, v in now.items() if then.get(k) != v]:
        raise ConfigError(
            f"the verdicts' monitor margins were calibrated at other generation settings: {'; '.join(differ)}. "
            "Run `quanthunt calibrate` and then `quanthunt verify` again for these settings (with DVC: "
            "`dvc repro --force calibrate`, then `dvc repro`)"
        )
    return c.monitor_margin


def monitors_for(
    verdicts: Verdicts, ledger: Ledger, *, dataset: str, datasets: int, margin: Margins, settings: MonitorParams,
    sampling: Sampling,
) -> dict[str, ProviderMonitor]:  # fmt: skip
    """One monitor per eligible provider, continuing the verify stage's audit, restored
    from the ledger when an earlier run of ``dataset`` left one. The error budget
    ``alpha`` is split evenly across the eligible providers and the ``datasets``."""
    eligible = verdicts.eligible()
    alpha = settings.alpha / max(len(eligible) * datasets, 1)
    sampler = sampler_testable(sampling)
    saved = ledger.monitor_states(verdicts.verification_run_id or UNLOGGED)
    out = {}
    for v in eligible:
        shifts: Sequence[float | None] = v.observed.shift if v.mode == "logprob" else [None] * len(v.observed.z)
        pits: Sequence[float | None] = v.observed.pit or [None] * len(v.observed.z)  # a file from before: Φ(z)
        monitor = ProviderMonitor.start(
            v.tag, v.mode, sampler=sampler, margin=margin, alpha=alpha, checkpoint_every=settings.checkpoint_every,
            audited=[Observation(s, z, pit) for s, z, pit in zip(shifts, v.observed.z, pits, strict=True)],
        )  # fmt: skip
        if (dataset, v.tag) in saved:
            monitor.restore(saved[dataset, v.tag])
        out[v.tag] = monitor
    return out


def suspect_checkpoints(states: Mapping[tuple[str, str], Mapping[str, Any]], dataset: str) -> dict[str, int]:
    """Tag → the checkpoint from which the provider's records of ``dataset`` are suspect
    (only providers its monitor stopped); ``states`` as ``Ledger.monitor_states`` gives them."""
    return {tag: int(state["stopped"]["suspect_from"]) for (ds, tag), state in states.items()
            if ds == dataset and state["stopped"] is not None}  # fmt: skip


def monitor_card(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A provider's monitor as a dataset card records it: replies monitored, the e-process
    after each scored one (``[index, e-value]``, for the report's plot) and any stop."""
    if state is None:
        return None
    # "threshold" is missing while no reply was scored yet (only the count was saved)
    return {"replies": state["served"], "threshold": state.get("threshold"), "e_path": state["path"], "stopped": state["stopped"]}


async def check_reference(reference: Reference, verdicts: Verdicts, url: str) -> None:
    """The monitor scores at the reference the verify stage used: it must be up and serve
    the same model."""
    try:
        model = (await reference.check()).model
    except GatewayError as exc:
        raise ConfigError(
            f"the reference deployment at {url} is needed while generating (generate.monitor.share > 0 scores a share "
            f"of the replies there) but did not answer: {exc}; start it, or set generate.monitor.share: 0"
        ) from None
    if model != verdicts.reference_model:
        raise ConfigError(
            f"the reference at {url} serves {model}, but the verdicts were measured against {verdicts.reference_model}"
        )


@dataclass
class Event:
    """A provider stopped by its monitor (for the console, MLflow and the summary)."""

    tag: str
    stop: Stop

    def line(self) -> str:
        s = self.stop
        return (
            f"monitor: stopped routing to {self.tag}: its e-process reached {s.e_value:.3g} at monitored reply "
            f"{s.at} ({s.test}); its records from checkpoint {s.suspect_from} on are quarantined"
        )


class Monitoring:
    """Runs the monitors of one dataset's run (see the module docstring)."""

    def __init__(
        self, monitors: Mapping[str, ProviderMonitor], scorer: Scorer, writer: LedgerWriter, *,
        verification_run_id: str, dataset: str, settings: MonitorParams, say: Callable[[str], None] = lambda _: None,
    ) -> None:  # fmt: skip
        self.monitors = dict(monitors)
        self.scorer = scorer
        self.writer = writer
        self.verification_run_id, self.dataset = verification_run_id, dataset
        self.settings = settings
        self.say = say
        """Where a stop's console line goes."""
        self.on_stop: Callable[[Event], None] = lambda _: None
        """What stops routing to the provider (the engine sets it)."""
        self.counts: Counter[str] = Counter()
        """monitored, scored, unscored and ``unscored.<why>``."""
        self.events: list[Event] = []
        self.conventions: defaultdict[str, Counter[str]] = defaultdict(Counter)
        """Per provider, its scored replies by how their logprobs read (``LogprobCompletion.convention``)."""
        self._gate = asyncio.Semaphore(settings.concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._saved_points = {tag: len(m.path) for tag, m in self.monitors.items()}

    def wants(self, key: RequestKey, tag: str) -> bool:
        """Whether this request is monitored: a stable hash of its key below ``share`` (the
        same requests in every rerun) and its provider monitored."""
        monitor = self.monitors.get(tag)
        if monitor is None or not monitor.monitored or monitor.stopped is not None:
            return False
        digest = hashlib.sha256(f"monitor:{key.record_id}:{key.turn}:{key.params_hash}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.settings.share

    def lagging(self, tag: str) -> bool:
        """Whether the provider has ``max_unscored`` monitored replies still being scored (it
        gets no new requests until the reference catches up)."""
        monitor = self.monitors.get(tag)
        return monitor is not None and monitor.served - monitor.fed >= self.settings.max_unscored

    def asks_logprobs(self, tag: str) -> bool:
        return self.monitors[tag].mode == "logprob"

    def stamp(self, tag: str) -> dict[str, Any] | None:
        """The provider's monitor state as a record's provenance names it."""
        monitor = self.monitors.get(tag)
        if monitor is None:
            return None
        return {"e_value": round(monitor.e_value, 6), "checkpoint": monitor.checkpoint, "monitored": monitor.monitored}

    def served(self, tag: str, key: RequestKey, messages: Sequence[Mapping[str, str]], reply: ChatReply) -> None:
        """A monitored request's reply arrived: give it the next index and score it in the
        background."""
        monitor = self.monitors[tag]
        index = monitor.next_index()
        self.counts["monitored"] += 1
        self.writer.submit(SaveMonitor(*self._key(monitor), served=monitor.served))
        label = f"{key.dataset}/{key.record_id}/{key.turn}"  # seeds the rank z's jitter
        task = asyncio.ensure_future(self._score(monitor, index, label, messages, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _score(
        self, monitor: ProviderMonitor, index: int, label: str, messages: Sequence[Mapping[str, str]], reply: ChatReply
    ) -> None:
        errors: Counter[str] = Counter()
        observation: Observation | None = None
        async with self._gate:
            try:
                observation = await self._observe(monitor, label, messages, reply, errors)
            except GatewayError as exc:
                errors[exc.kind] += 1
        self.counts["scored" if observation is not None else "unscored"] += 1
        self.counts.update(f"unscored.{kind}" for kind in errors)
        stop = monitor.feed(index, observation)
        self._save(monitor)
        if stop is not None:
            event = Event(monitor.tag, stop)
            self.events.append(event)
            self.say(event.line())
            self.on_stop(event)

    async def _observe(
        self, monitor: ProviderMonitor, label: str, messages: Sequence[Mapping[str, str]], reply: ChatReply, errors: Counter[str]
    ) -> Observation | None:
        if thought_while_off(self.scorer.reasoning, reply, errors):
            return None
        prompt = await self.scorer.prompt_ids(messages, errors)
        if monitor.mode == "logprob":
            if not reply.logprobs:
                errors["no_logprobs"] += 1
                return None
            completion = await self.scorer.logprobs(prompt, reply, errors, probe_id=label, index=0, seq=0)
            if not completion.deltas:
                errors["unpaired_tokens"] += 1
                return None
            self.conventions[monitor.tag][completion.convention] += 1
            return Observation(completion.mean_abs_delta, completion.rank_z, completion.rank_pit)
        ids = await self.scorer.completion_ids(reply.content, reply.reasoning, reply.finish_reason, errors)
        text = await self.scorer.text(prompt, ids, errors, probe_id=label, index=0, source="provider", seq=0)
        return Observation(None, text.rank_z, text.rank_pit) if text.tokens else None

    def _key(self, monitor: ProviderMonitor) -> tuple[str, str, str]:
        return self.verification_run_id, self.dataset, monitor.tag

    def _save(self, monitor: ProviderMonitor) -> None:
        """The state after each applied observation (a few kB) and the path's new points,
        so a kill -9 loses at most the replies still being scored."""
        points = monitor.path[self._saved_points.get(monitor.tag, 0) :]
        self._saved_points[monitor.tag] = len(monitor.path)
        self.writer.submit(SaveMonitor(*self._key(monitor), served=monitor.served, state=monitor.state(with_path=False),
                                       points=points))  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """Each provider's monitor now, and what the monitor did (the stage's metrics)."""
        providers = {}
        for tag, m in self.monitors.items():
            stopped = None if m.stopped is None else m.stopped.__dict__
            providers[tag] = {"mode": m.mode, "monitored": m.monitored, "replies": m.served, "e_value": round(m.e_value, 6),
                              "threshold": round(m.threshold, 3), "checkpoint": m.checkpoint, "stopped": stopped,
                              "logprobs_read_as": dict(self.conventions[tag])}  # fmt: skip
        return {"enabled": True, "counts": dict(self.counts), "providers": providers}

    async def close(self) -> None:
        """Wait for the scorings still running (their observations are part of the run)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
