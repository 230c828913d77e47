"""Derive standalone JSON Schemas from OpenRouter's published OpenAPI spec.

Usage: ``python tools/derive_contracts.py PATH/TO/openrouter-openapi.yaml tests/contracts``

The project never reads the spec at run time or in tests: this one-off tool cuts the
schemas the gateway client and the sandbox must honour out of the spec, resolves their
``$ref``s into ``$defs`` and writes one JSON file per schema. The files are committed as
test fixtures; rerun the tool when the spec changes and review the diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOTS = [
    # replies
    "ModelsListResponse",
    "ListEndpointsResponse",
    "PublicEndpoint",
    "ChatResult",
    "ChatStreamingResponse",
    "GenerationResponse",
    "BadRequestResponse",
    "UnauthorizedResponse",
    "PaymentRequiredResponse",
    "NotFoundResponse",
    "TooManyRequestsResponse",
    "InternalServerResponse",
    "BadGatewayResponse",
    "ServiceUnavailableResponse",
    "RequestTimeoutResponse",
    # requests
    "ChatRequest",
    "ProviderPreferences",
    "Quantization",
]
PATH_ROOTS = {
    # inline reply schemas, named here: (path, method, status)
    "KeyResponse": ("/key", "get", "200"),
}
PREFIX = "#/components/schemas/"


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            found.add(ref[len(PREFIX) :])
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def _rewrite(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith(PREFIX):
                out[key] = "#/$defs/" + value[len(PREFIX) :]
            elif key in ("example", "examples") or key.startswith("x-"):
                continue
            else:
                out[key] = _rewrite(value)
        return out
    if isinstance(node, list):
        return [_rewrite(v) for v in node]
    return node


def derive(spec: dict[str, Any], root: str) -> dict[str, Any]:
    schemas = dict(spec["components"]["schemas"])
    if root in PATH_ROOTS:
        path, method, status = PATH_ROOTS[root]
        reply = spec["paths"][path][method]["responses"][status]
        schemas[root] = reply["content"]["application/json"]["schema"]
    todo, seen = [root], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_refs(schemas[name]) - seen)
    body = _rewrite(schemas[root])
    defs = {name: _rewrite(schemas[name]) for name in sorted(seen - {root})}
    out: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": root}
    out.update(body)
    if defs:
        out["$defs"] = defs
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    spec = yaml.safe_load(Path(argv[1]).read_text(encoding="utf-8"))
    outdir = Path(argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    for root in [*ROOTS, *PATH_ROOTS]:
        path = outdir / f"{root}.schema.json"
        path.write_text(json.dumps(derive(spec, root), indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
