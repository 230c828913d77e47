"""The verify stage's audit figures: three labelled panels each, read back from the PNG's
own description, for a faithful provider (every Δ zero), a shifted one, and an audit with
nothing measured."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from quanthunt import figures


def description(png: bytes) -> str:
    assert png[:4] == b"\x89PNG"
    text: dict[str, str] = Image.open(io.BytesIO(png)).text  # type: ignore[attr-defined]
    return text["Description"]


def test_logprob_audit_draws_the_ecdf_the_histogram_and_the_e_process() -> None:
    drawn = description(
        figures.logprob_audit(
            "Shifted | fp4",
            [0.1, -0.4, 0.0, 2.5],
            [0.2, 1.1],
            margin=0.05,
            tail=1.0,
            wealth=[1.0, 3.0, 40.0],
            threshold=20.0,
        )
    )
    lines = drawn.splitlines()
    assert lines[0] == "figure: Shifted | fp4"
    assert "x: |Δ logprob| per token" in lines[1]
    assert "x: mean |Δ logprob| per completion | y: completions | legend: margin 0.05; extreme > 1" in lines[2]
    assert len(lines) == 4 and lines[3].startswith("axes 3:")


def test_a_faithful_provider_shows_every_token_at_zero() -> None:
    png = figures.logprob_audit("Faithful", [0.0] * 12, [0.0, 0.0], margin=0.05, tail=1.0, wealth=[1.0], threshold=20.0)
    assert "x: mean |Δ logprob| per completion" in description(png)


def test_sample_audit_labels_both_sources_and_survives_an_empty_audit() -> None:
    drawn = description(figures.sample_audit("Sampled", [0.5, 1.5, 2.0], [-0.3, 0.1, 0.2], wealth=[1.0, 0.5], threshold=20.0))
    middle = drawn.splitlines()[2]
    assert "x: rank z | y: completions | legend: provider; reference" in middle
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no legend asked of a panel with nothing labelled
        empty = description(figures.sample_audit("Nothing measured", [], [], wealth=[], threshold=20.0))
    assert empty.splitlines()[0] == "figure: Nothing measured" and "x: rank z" in empty


def test_a_monitor_scored_once_is_drawn_as_a_visible_point() -> None:
    """A short run monitors a provider once or twice: a line through one point drew
    nothing (the report's monitoring plots were empty); short paths get a marker each."""
    import matplotlib.pyplot as plt

    fig = figures.monitors_figure("chat: monitors", {"alpha/int4": [[0, 1.4]], "beta/int4": [[i, 1.0] for i in range(200)]},
                                  {"alpha/int4": 40.0})  # fmt: skip
    (ax,) = fig.axes
    single, long = ax.get_lines()[:2]
    assert single.get_marker() == "o" and len(single.get_xdata()) == 1
    assert long.get_marker() in ("None", None, "")  # a long path is a line
    low, high = ax.get_ylim()
    assert low < 1.4 < high and ax.get_xlim()[0] <= 1 <= ax.get_xlim()[1]
    plt.close(fig)
    assert "monitored replies" in description(figures.monitors("chat: monitors", {"alpha/int4": [[0, 1.4]]}, {}))
