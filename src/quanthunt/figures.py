"""Plots for the reports (matplotlib, Agg backend), returned as PNG bytes so pages can
embed them and DVC can track them as files."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def file_name(tag: str) -> str:
    """The PNG file of an endpoint's plot (``deepinfra/fp4`` -> ``deepinfra-fp4.png``)."""
    return re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-") + ".png"


def _figure(width: float = 10.0, height: float = 3.2) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(width, height), dpi=110)
    return fig, axes


def _e_process(ax: Any, wealth: Sequence[float], threshold: float) -> None:
    """The combined difference e-process after each completion, on a log scale, against the
    wealth that makes the provider ``different`` (1/α times the providers, Holm's worst case)."""
    ax.plot(range(1, len(wealth) + 1), [max(w, 1e-6) for w in wealth], color="#4477aa")
    ax.axhline(threshold, color="#ee6677", linestyle=":", label=f"different at ≥ {threshold:g}")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("audited completions")
    ax.set_ylabel("e-process (wealth)")
    ax.legend(fontsize=7)


def monitors(title: str, paths: Mapping[str, Sequence[Sequence[float]]], thresholds: Mapping[str, float]) -> bytes:
    """Each provider's monitor e-process over a generation run (``[index, e-value]`` after
    each scored reply), on a log scale, with the wealth that stops the provider."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.2), dpi=110)
    for number, (tag, path) in enumerate(sorted(paths.items())):
        color = f"C{number % 10}"
        ax.plot([p[0] + 1 for p in path], [max(p[1], 1e-6) for p in path], color=color, label=tag)
        if tag in thresholds:
            ax.axhline(thresholds[tag], color=color, linestyle=":", linewidth=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("monitored replies")
    ax.set_ylabel("e-process (dotted: stop)")
    ax.legend(fontsize=7)
    return png(fig)


def png(fig: Any) -> bytes:
    """Render a figure to PNG bytes and close it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    data: bytes = buffer.getvalue()
    return data


def _ecdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=float))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label, **style)


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
    """Left: ECDF of per-token |Δ logprob|. Middle: per-completion mean |Δ| against the
    equivalence margin and the extreme-completion threshold. Right: the e-process."""
    fig, (left, right, third) = _figure()
    _ecdf(left, [abs(d) for d in deltas], "per token")
    left.set_xscale("symlog", linthresh=1e-3)
    left.set_xlabel("|Δ logprob| (provider − reference)")
    left.set_ylabel("ECDF")
    left.set_title(title, fontsize=9)
    right.hist(completion_means, bins=20, color="#4477aa")
    right.axvline(margin, color="#228833", linestyle="--", label=f"margin {margin:g}")
    right.axvline(tail, color="#ee6677", linestyle=":", label=f"extreme > {tail:g}")
    right.set_xlabel("mean |Δ| per completion")
    right.set_ylabel("completions")
    right.legend(fontsize=7)
    _e_process(third, wealth, threshold)
    return png(fig)


def sample_audit(
    title: str, provider: Sequence[float], reference: Sequence[float], *, wealth: Sequence[float], threshold: float
) -> bytes:
    """ECDFs and histograms of the rank z (each token's PIT under the reference as a normal
    score, summed over √tokens) of provider vs reference samples: N(0, 1) for the reference's
    own text. Right: the e-process."""
    fig, (left, right, third) = _figure()
    _ecdf(left, provider, "provider samples", color="#ee6677")
    _ecdf(left, reference, "reference samples", color="#4477aa")
    left.set_xlabel("rank z (N(0, 1) for the reference's own text)")
    left.set_ylabel("ECDF")
    left.set_title(title, fontsize=9)
    left.legend(fontsize=7)
    right.hist([provider, reference], bins=15, label=["provider", "reference"], color=["#ee6677", "#4477aa"])
    right.set_xlabel("rank z")
    right.set_ylabel("completions")
    right.legend(fontsize=7)
    _e_process(third, wealth, threshold)
    return png(fig)


def bars(title: str, values: Mapping[str, float], *, xlabel: str) -> bytes:
    """A horizontal bar chart (cost by provider, records by dataset, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 0.4 * max(len(values), 2) + 1), dpi=110)
    names = list(values)
    ax.barh(names, [values[n] for n in names], color="#4477aa")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    return png(fig)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
