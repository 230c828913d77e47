"""``dvc plots show`` works offline: the page it writes carries Vega, Vega-Lite and
vega-embed inline (the template ``.dvc/config`` names), loads nothing from a CDN, and
draws the report's plots in a browser with no network."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fixtures.project import REPO, Project

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
OFFLINE = [  # every host resolves nowhere and every proxied request goes to a closed port
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=socks5://127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]  # fmt: skip


@pytest.fixture
def plots_page(project: Project) -> Path:
    """``dvc plots show`` of the report's two plots (the CSVs the report stage writes)."""
    assert (REPO / ".dvc/plots.html").is_file(), "no .dvc/plots.html: run `make install` (it builds the template)"
    plots = project.root / "reports/plots"
    plots.mkdir(parents=True)
    (plots / "verification.csv").write_text(
        "tag,provider,verdict,mode,effect,ci_low,ci_high\n"
        "alpha/int4,Alpha,equivalent,logprobs,0.01,-0.02,0.04\n"
        "beta/fp4,Beta,different,logprobs,0.3,0.2,0.4\n"
    )
    (plots / "cost.csv").write_text("dataset,tag,provider,cost_usd,records\nchat,alpha/int4,Alpha,0.002,12\n")
    done = project.dvc("plots", "show", "-o", "plots_page")
    assert done.returncode == 0, done.stderr
    return project.root / "plots_page/index.html"


def test_page_loads_no_script_from_the_network(plots_page: Path) -> None:
    page = plots_page.read_text()
    assert re.findall(r"<script[^>]*\ssrc=", page) == []  # DVC's default page loads three from jsDelivr
    for package in ("vega 5.", "vega-lite 5.", "vega-embed 6."):
        assert f"/* {package}" in page
    assert page.count("vegaEmbed('#") == 2  # both plots, embedded by DVC into our template


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (CI installs Debian's chromium)")
def test_chromium_draws_the_plots_offline(plots_page: Path, tmp_path: Path) -> None:
    dom = subprocess.run(
        [str(CHROMIUM), *CHROMIUM_FLAGS, *OFFLINE, f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=10000", "--dump-dom", plots_page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    drawn = re.findall(r'<(canvas|svg)[^>]*class="marks"', dom)
    assert len(drawn) == 2, dom[-2000:]
