"""How engine output is rendered as OpenRouter/OpenAI JSON."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from quanthunt.sandbox.engine import Completion, OutToken


def error_response(
    status: int, message: str, *, metadata: dict[str, Any] | None = None, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """OpenRouter's error body: ``{"error": {"code", "message", "metadata"?}}``."""
    error: dict[str, Any] = {"code": status, "message": message}
    if metadata is not None:
        error["metadata"] = metadata
    error.update(extra)
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def logprob_item(token: OutToken, *, as_ids: bool = False) -> dict[str, Any]:
    """One entry of ``choices[].logprobs.content`` (OpenAI/OpenRouter ``ChatTokenLogprob``)."""

    def text(t: Any) -> str:
        return f"token_id:{t.id}" if as_ids else str(t.text)

    return {
        "token": text(token.token),
        "logprob": token.logprob,
        "bytes": list(token.token.bytes),
        "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(t.bytes)} for t, lp in token.top],
    }


def text_deltas(completion: Completion) -> list[str]:
    """Split a completion's text into per-token pieces whose concatenation is the text.
    Bytes of a character split across tokens are held until it is whole."""
    pieces, pending, emitted = [], b"", 0
    for token in completion.tokens:
        pending += token.token.bytes
        try:
            piece = pending.decode("utf-8")
        except UnicodeDecodeError:
            pieces.append("")
            continue
        pending = b""
        piece = piece[: max(len(completion.text) - emitted, 0)]
        emitted += len(piece)
        pieces.append(piece)
    if emitted < len(completion.text):
        pieces.append(completion.text[emitted:])
    return pieces
