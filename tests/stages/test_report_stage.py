"""The report page: built from a validated dataset and verdicts, self-contained, and
rendered by headless Chromium with every plot loaded."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fixtures.generation import GenerationBed

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]  # fmt: skip
SECTIONS = ("summary", "providers", "verdicts", "shift", "power", "datasets", "monitoring", "cost", "tokens")


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.images: list[str] = []
        self.alts: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag == "img":
            self.images.append(str(values.get("src", "")))
            self.alts.append(str(values.get("alt", "")))
        for name in ("src", "href"):
            if values.get(name, "") and str(values[name]).startswith(("http:", "https:", "//")):
                self.external.append(str(values[name]))


@pytest.fixture
def reported(generation_bed: Callable[..., GenerationBed]) -> GenerationBed:
    bed = generation_bed(records=10, params={"generate.monitor.share": 1.0})  # every reply monitored: a plot to draw
    assert bed.generate().returncode == 0
    assert bed.project.run("validate", "tiny", "--params", "params.yaml").returncode == 0
    done = bed.project.run("report", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    return bed


def test_page_is_self_contained_with_every_section(reported: GenerationBed) -> None:
    page = Page()
    page.feed((reported.project.root / "reports/index.html").read_text())
    assert set(SECTIONS) <= page.ids
    assert len(page.images) >= 5 and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert any("monitors of tiny" in alt for alt in page.alts)
    assert page.external == []
    with (reported.project.root / "reports/plots/cost.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["provider"] for r in rows} <= {"Alpha", "Beta"} and sum(float(r["cost_usd"]) for r in rows) > 0


@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (CI installs Debian's chromium); the parser-level test above ran"
)
def test_chromium_renders_every_plot(reported: GenerationBed, tmp_path: Path) -> None:
    page = (reported.project.root / "reports/index.html").resolve().as_uri()
    profile = tmp_path / "profile"
    common = [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
    dom = subprocess.run([*common, "--dump-dom", page], capture_output=True, text=True, timeout=120, check=True).stdout
    loaded = re.search(r'data-images-loaded="(\d+)"', dom)
    total = re.search(r'data-images-total="(\d+)"', dom)
    assert loaded and total and int(total.group(1)) >= 4
    assert loaded.group(1) == total.group(1)  # every embedded plot decoded and laid out
    shot = tmp_path / "report.png"
    subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1400,3000", page], capture_output=True, timeout=120, check=True
    )
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000
