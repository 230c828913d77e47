"""Screenshot the report's overview (the audit at a glance) for the README.

Usage: ``python docs/screenshot_overview.py reports/index.html docs/report-overview.png``

Renders the page's ``overview`` section alone (the page's own styles) in headless
Chromium and trims the blank space below it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageChops


def main(page: Path, target: Path, *, width: int = 1080) -> None:
    text = page.read_text(encoding="utf-8")
    head = text[: text.index("<body>")]
    section = re.search(r"<section id='overview'>.*?</section>", text, flags=re.S)
    if section is None:
        raise SystemExit(f"{page}: no overview section")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no Chromium on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "overview.html"
        html.write_text(f"{head}<body>{section.group()}</body></html>", encoding="utf-8")
        shot = Path(tmp) / "shot.png"
        command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--user-data-dir={Path(tmp) / 'profile'}", f"--window-size={width},2400", f"--screenshot={shot}",
                   html.as_uri()]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=120)  # noqa: S603 - the browser, fixed arguments
        image = Image.open(shot).convert("RGB")
        box = ImageChops.difference(image, Image.new("RGB", image.size, "white")).getbbox()
        bottom = min(image.height, (box[3] if box else image.height) + 24)
        image.crop((0, 0, width, bottom)).save(target, optimize=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
