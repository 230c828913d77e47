"""Plots for the reports (matplotlib, Agg backend), returned as PNG bytes so pages can
embed them and DVC can track them as files. Every axis is labelled, and each PNG says
what it draws in its ``Description`` text chunk (title, axis labels, rows and legend of
every panel), for readers that cannot see it and for the tests."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WIDTH_IN = 10.0
"""Every figure is this wide at ``DPI``: 1,000 pixels, the page's column (it scales down)."""
DPI = 100
VERDICT_COLORS = {"equivalent": "#228833", "different": "#cc3311", "inconclusive": "#ee9900"}
"""Verdict colours (Paul Tol's bright scheme), on the plots and the page alike."""


def subplots(columns: int = 1, *, height: float = 3.2, **options: Any) -> tuple[Any, Any]:
    """A figure ``WIDTH_IN`` wide with ``columns`` panels side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(WIDTH_IN, height), dpi=DPI, **options)


def _e_process(ax: Any, wealth: Sequence[float], threshold: float) -> None:
    """The combined difference e-process after each completion, on a log scale, against the
    wealth that makes the provider ``different`` (1/α times the providers, Holm's worst case)."""
    ax.plot(range(1, len(wealth) + 1), [max(w, 1e-6) for w in wealth], color="#4477aa", label="e-process")
    ax.axhline(threshold, color="#ee6677", linestyle=":", label=f"different at ≥ {threshold:g}")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("audited completions")
    ax.set_ylabel("e-process (wealth)")
    ax.legend(fontsize=7)


def monitors(title: str, paths: Mapping[str, Sequence[Sequence[float]]], thresholds: Mapping[str, float]) -> bytes:
    """Each provider's monitor e-process over a generation run (``[index, e-value]`` after
    each scored reply), on a log scale, with the wealth that stops the provider."""
    return png(monitors_figure(title, paths, thresholds))


MARKED_UP_TO = 60
"""Paths of at most this many scored replies are drawn with a marker at each: a short run
monitors a provider once or twice, and a line through one point draws nothing."""


def monitors_figure(title: str, paths: Mapping[str, Sequence[Sequence[float]]], thresholds: Mapping[str, float]) -> Any:
    fig, ax = subplots(height=3.0)
    for number, (tag, path) in enumerate(sorted(paths.items())):
        color = f"C{number % 10}"
        marker = "o" if len(path) <= MARKED_UP_TO else None
        ax.plot([p[0] + 1 for p in path], [max(p[1], 1e-6) for p in path], color=color, label=tag, marker=marker,
                markersize=3)  # fmt: skip
        if tag in thresholds:
            ax.axhline(thresholds[tag], color=color, linestyle=":", linewidth=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("monitored replies")
    ax.set_ylabel("e-process (dotted: stop)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def describe(fig: Any) -> str:
    """What ``fig`` draws, one line per panel: ``axes N: title | x: label | y: label``, then
    its rows (text tick labels) and legend entries when it has them."""
    lines = [f"figure: {fig._suptitle.get_text()}"] if fig._suptitle is not None else []
    for number, ax in enumerate((a for a in fig.axes if a.axison), start=1):
        parts = [f"axes {number}: {ax.get_title()}", f"x: {ax.get_xlabel()}", f"y: {ax.get_ylabel()}"]
        rows = [t.get_text() for t in ax.get_yticklabels() if t.get_text() and not _numeric(t.get_text())]
        if rows:
            parts.append("rows: " + "; ".join(rows))
        legend = ax.get_legend()
        if legend is not None:
            parts.append("legend: " + "; ".join(t.get_text() for t in legend.get_texts()))
        lines.append(" | ".join(parts))
    for legend in fig.legends:
        lines.append("legend: " + "; ".join(t.get_text() for t in legend.get_texts()))
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    try:
        float(re.sub(r"[−$]", lambda m: "-" if m.group() == "−" else "", text).replace("%", "").replace(",", ""))
    except ValueError:
        return bool(re.fullmatch(r"\$?\\?mathdefault\{.*\}\$?|\$.*\$", text))
    return True


def png(fig: Any) -> bytes:
    """Render a figure to PNG bytes (with its ``describe`` text) and close it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(buffer, format="png", metadata={"Description": describe(fig)})
    plt.close(fig)
    data: bytes = buffer.getvalue()
    return data


def _counts(ax: Any) -> None:
    """Whole-number ticks on a count axis."""
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _audit_figure_done(fig: Any, middle: Any, right: Any, *, xlabel: str, wealth: Sequence[float], threshold: float) -> bytes:
    """An audit figure's common ending: the middle panel's per-completion histogram labelled,
    the e-process on the right, and the PNG."""
    middle.set_xlabel(xlabel)
    middle.set_ylabel("completions")
    _counts(middle)
    _legend(middle)
    _e_process(right, wealth, threshold)
    return png(fig)


def _legend(ax: Any) -> None:
    """A legend of the panel's labelled artists, if it has any (an audit with nothing measured has none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _ecdf(ax: Any, values: Sequence[float], label: str, *, right: float | None = None, **style: Any) -> None:
    """The empirical CDF, drawn on to ``right`` (so values all at one point still show a line)."""
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    if right is not None and right > xs[-1]:
        xs, ys = np.append(xs, right), np.append(ys, 1.0)
    ax.step(xs, ys, where="post", label=label, **style)


LOG_TICKS = (0.0, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


def logprob_audit(
    title: str,
    deltas: Sequence[float],
    completion_means: Sequence[float],
    *,
    margin: float,
    tail: float,
    wealth: Sequence[float],
    threshold: float,
) -> bytes:
    """Left: ECDF of per-token |Δ logprob| (0 to the largest, symmetric-log axis with a tick
    per decade). Middle: per-completion mean |Δ| on bins from 0 past the extreme-completion
    threshold (so a faithful provider's near-zero shifts are a visible bar at 0, not a
    sliver), against the equivalence margin and that threshold. Right: the e-process."""
    fig, (left, middle, right) = subplots(3)
    fig.suptitle(title, fontsize=10)
    magnitudes = [abs(d) for d in deltas]
    edge = max([*magnitudes, 1e-2]) * 1.5
    _ecdf(left, magnitudes, "per token", right=edge, color="#4477aa", linewidth=1.5)
    if magnitudes and max(magnitudes) == 0:
        left.text(edge / 50, 0.5, f"all {len(magnitudes):,} tokens: |Δ| = 0", fontsize=8, color="#4477aa")
    left.set_xscale("symlog", linthresh=1e-3, linscale=0.5)
    left.set_xlim(0, edge)
    ticks = [t for t in LOG_TICKS if t <= edge]
    left.set_xticks(ticks, [f"{t:g}" for t in ticks])
    left.set_ylim(0, 1.02)
    left.set_xlabel("|Δ logprob| per token")
    left.set_ylabel("share of tokens ≤ x (ECDF)")
    upper = max([tail * 1.2, *completion_means])
    middle.hist(np.clip(completion_means, 0, upper), bins=np.linspace(0, upper, 25), color="#4477aa")
    middle.axvline(margin, color="#228833", linestyle="--", label=f"margin {margin:g}")
    middle.axvline(tail, color="#ee6677", linestyle=":", label=f"extreme > {tail:g}")
    middle.set_xlim(0, upper)
    return _audit_figure_done(fig, middle, right, xlabel="mean |Δ logprob| per completion", wealth=wealth, threshold=threshold)


def sample_audit(
    title: str, provider: Sequence[float], reference: Sequence[float], *, wealth: Sequence[float], threshold: float
) -> bytes:
    """ECDFs and histograms of the rank z (each token's PIT under the reference as a normal
    score, summed over a fixed horizon: ``measurements.rank``) of provider vs reference
    samples: N(0, 1) for the reference's own text. Right: the e-process."""
    fig, (left, middle, right) = subplots(3)
    fig.suptitle(title, fontsize=10)
    _ecdf(left, provider, "provider samples", color="#ee6677")
    _ecdf(left, reference, "reference samples", color="#4477aa")
    left.set_xlabel("rank z (N(0, 1) for the reference's own text)")
    left.set_ylabel("share of completions ≤ z (ECDF)")
    _legend(left)
    both = [*provider, *reference]
    low, high = (min(both), max(both)) if both else (-3.0, 3.0)
    bins = np.linspace(min(low, -3.0), max(high, 3.0), 25)
    for values, label, color in ((provider, "provider", "#ee6677"), (reference, "reference", "#4477aa")):
        if values:
            middle.hist(values, bins=bins, histtype="stepfilled", alpha=0.45, color=color, label=label)
    return _audit_figure_done(fig, middle, right, xlabel="rank z", wealth=wealth, threshold=threshold)


Interval = tuple[float, float, float]
"""An estimate and its 95 % interval: ``(value, low, high)``."""


@dataclass(frozen=True)
class OverviewRow:
    """One audited provider in the overview: its sampler shift (mean PIT − ½) and, in
    logprob mode, its mean |Δ logprob| per completion, each with its interval."""

    label: str
    verdict: str
    sampler: Interval | None
    logprob: Interval | None
    missing: str = "not measured"
    """Said where an interval is missing."""


def overview(
    rows: Sequence[OverviewRow], *, sampler_shift: float, sampler_equivalence: float, logprob_margin: float, tail: float
) -> bytes:
    """Every audited provider's effects with their confidence intervals against the margins,
    coloured by verdict: left the sampler (both modes), right the numbers (logprob mode)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, (left, right) = subplots(2, height=1.6 + 0.4 * max(len(rows), 2), sharey=True, layout="constrained")
    ys = np.arange(len(rows))[::-1]
    for y, row in zip(ys, rows, strict=True):
        color = VERDICT_COLORS.get(row.verdict, "grey")
        if row.sampler is not None:
            value, low, high = row.sampler
            _interval(left, y, (value - 0.5, low - 0.5, high - 0.5), color)
        else:
            left.text(-0.48, y, row.missing, va="center", fontsize=8, color="grey")
        if row.logprob is not None:
            _interval(right, y, row.logprob, color)
        else:
            right.text(0.005, y, row.missing, va="center", fontsize=8, color="grey")
    left.axvspan(-sampler_equivalence, sampler_equivalence, color="#228833", alpha=0.12)
    for sign in (-1, 1):
        left.axvline(sign * sampler_shift, color="#cc3311", linestyle=":", linewidth=1)
    left.axvline(0, color="grey", linewidth=0.6)
    left.set_xlim(-0.5, 0.5)
    left.set_xlabel("sampler: mean Φ(rank z) − ½, 95 % CI")
    left.set_ylabel("provider (completions)")
    left.set_yticks(ys, [r.label for r in rows])
    left.set_ylim(-0.6, len(rows) - 0.4)
    right.axvspan(0, logprob_margin, color="#228833", alpha=0.12)
    right.axvline(tail, color="#cc3311", linestyle=":", linewidth=1)
    right.set_xlim(-tail * 0.03, tail * 1.12)
    right.set_xlabel("numbers: mean |Δ logprob| per completion, 95 % CI")
    right.set_ylabel("provider")
    right.tick_params(labelleft=False)
    handles: list[Any] = [Line2D([], [], marker="o", linestyle="", color=c, label=v) for v, c in VERDICT_COLORS.items()]
    handles += [
        Patch(color="#228833", alpha=0.25, label=f"sampler equivalence margin ±{sampler_equivalence:g}"),
        Line2D([], [], color="#cc3311", linestyle=":", label=f"sampler shift ±{sampler_shift:g}; extreme > {tail:g}"),
        Patch(color="#228833", alpha=0.25, label=f"logprob margin {logprob_margin:g}"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return png(fig)


def _interval(ax: Any, y: float, interval: Interval, color: str) -> None:
    value, low, high = interval
    ax.errorbar([value], [y], xerr=[[max(value - low, 0.0)], [max(high - value, 0.0)]], fmt="o", color=color,
                capsize=3, markersize=6, linewidth=1.5)  # fmt: skip


def stacked_bars(ax: Any, values: Mapping[str, Mapping[str, float]], *, xlabel: str, ylabel: str) -> None:
    """Horizontal bars, one per key of ``values``, stacked by the inner keys (one colour each)."""
    rows = list(values)
    parts = sorted({part for inner in values.values() for part in inner})
    left = np.zeros(len(rows))
    for number, part in enumerate(parts):
        widths = np.array([values[r].get(part, 0.0) for r in rows])
        ax.barh(rows, widths, left=left, color=f"C{number % 10}", label=part)
        left += widths
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.invert_yaxis()


def served(records: Mapping[str, Mapping[str, float]], cost: Mapping[str, Mapping[str, float]]) -> bytes:
    """Who served the training data: records and USD per provider, stacked by dataset."""
    fig, (left, right) = subplots(2, height=1.4 + 0.35 * max(len(records), 2), sharey=True)
    stacked_bars(left, records, xlabel="records served", ylabel="provider")
    stacked_bars(right, cost, xlabel="USD paid for its replies", ylabel="provider")
    right.tick_params(labelleft=False)
    right.legend(title="dataset", fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return png(fig)


def budget(bars: Sequence[tuple[str, float, str]], *, budget_usd: float) -> bytes:
    """The budget plan against the spend: one bar per ``(label, usd, kind)`` on a log axis
    (a sandbox run spends cents of a $100 plan), the budget as a line."""
    colors = {"plan": "#bbbbbb", "spent": "#4477aa", "projected": "#66ccee"}
    fig, ax = subplots(height=1.2 + 0.33 * max(len(bars), 2))
    low = min([usd for _, usd, _ in bars if usd > 0] + [budget_usd]) / 3
    labels = [label for label, _, _ in bars]
    ax.barh(labels, [max(usd, low) for _, usd, _ in bars], color=[colors.get(kind, "grey") for _, _, kind in bars])
    for y, (_, usd, _) in enumerate(bars):
        ax.text(max(usd, low) * 1.15, y, f"${usd:,.4f}" if usd < 1 else f"${usd:,.2f}", va="center", fontsize=8)
    ax.axvline(budget_usd, color="#cc3311", linestyle="--", label=f"budget ${budget_usd:,.2f}")
    ax.set_xscale("log")
    ax.set_xlim(low, max([budget_usd, *(u for _, u, _ in bars)]) * 8)
    ax.set_xlabel("USD (log scale)")
    ax.set_ylabel("planned / spent")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    return png(fig)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
