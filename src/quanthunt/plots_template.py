"""The HTML page ``dvc plots show`` fills, with Vega inlined so the plots draw offline.

DVC's own page loads Vega, Vega-Lite and vega-embed from a CDN: without the internet the
page is blank. This template carries the three scripts inline, read from the npm
packages ``make install`` puts in ``tools/vega/node_modules`` (versions pinned by
``tools/vega/package-lock.json``); ``.dvc/config`` names it (``plots.html_template``).

Without the packages (no npm), ``make install`` writes the page with DVC's CDN scripts
instead, so ``dvc plots show`` still works online rather than failing on a missing file.

Usage::

    python -m quanthunt.plots_template .dvc/plots.html --node-modules tools/vega/node_modules
    python -m quanthunt.plots_template .dvc/plots.html   # the CDN page
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quanthunt.errors import ConfigError
from quanthunt.outputs import write_atomic

SCRIPTS = ("vega/build/vega.min.js", "vega-lite/build/vega-lite.min.js", "vega-embed/build/vega-embed.min.js")
"""In load order: vega-embed's UMD build uses the ``vega`` and ``vegaLite`` globals."""
PLACEHOLDERS = ("{plot_divs}", "{refresh_tag}", "{scripts}")
"""What DVC replaces in a template (dvc_render.html). The template has no ``{scripts}``,
where DVC would put its CDN ``<script src>`` tags."""
HEAD = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
"""
TAIL = """    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def inline_script(node_modules: Path, relative: str) -> str:
    """One package's browser build as an inline ``<script>``, its name and version in a comment."""
    path = node_modules / relative
    package = relative.split("/", 1)[0]
    try:
        code = path.read_text(encoding="utf-8")
        version = json.loads((node_modules / package / "package.json").read_text(encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc}); run `make install` (npm ci in tools/vega)") from None
    if "</script" in code.lower() or any(p in code for p in PLACEHOLDERS):
        raise ConfigError(f"{path}: holds '</script' or a DVC placeholder, so it cannot be inlined")
    return f"    <script>/* {package} {version} */\n{code}\n    </script>\n"


def render(node_modules: Path | None) -> str:
    """The template's text: DVC's default page with the three scripts inline, or with
    DVC's own CDN scripts (``{scripts}``) where ``node_modules`` is None."""
    if node_modules is None:
        return HEAD + "    {scripts}\n" + TAIL
    return HEAD + "".join(inline_script(node_modules, s) for s in SCRIPTS) + TAIL


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m quanthunt.plots_template", description=__doc__.split("\n")[0])
    parser.add_argument("template", type=Path, help="the page to write (.dvc/plots.html)")
    parser.add_argument("--node-modules", type=Path, help="where npm put vega, vega-lite and vega-embed")
    args = parser.parse_args(argv)
    try:
        page = render(args.node_modules)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    write_atomic(args.template, page.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
