"""How engine output is rendered as OpenRouter/OpenAI JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from quanthunt.sandbox.engine import Completion, OutToken, TokenInfo


def error_response(
    status: int, message: str, *, metadata: dict[str, Any] | None = None, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """OpenRouter's error body: ``{"error": {"code", "message", "metadata"?}}``."""
    error: dict[str, Any] = {"code": status, "message": message}
    if metadata is not None:
        error["metadata"] = metadata
    error.update(extra)
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class ContextNames:
    """Names tokens as vLLM's incremental detokenizer does: the text a token adds after the
    bytes still pending from earlier tokens, and ``""`` while that text ends inside a
    character (a partial UTF-8 piece). Alternatives at a position are named in the same
    context as the token chosen there."""

    def __init__(self) -> None:
        self.pending = b""

    def name(self, token: TokenInfo) -> str:
        text = (self.pending + token.bytes).decode("utf-8", errors="replace")
        return "" if text.endswith("\ufffd") else text

    def advance(self, token: TokenInfo) -> str:
        """The name of the token chosen at this position; moves past it."""
        name = self.name(token)
        self.pending = self.pending + token.bytes if name == "" else b""
        return name


def logprob_items(tokens: Sequence[OutToken], *, as_ids: bool = False, top_logprobs: int = 0) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` (``ChatTokenLogprob``) as vLLM renders it: every token
    named in context (``ContextNames``), ``top_logprobs`` the sampled token first, then the
    likeliest others, ``top_logprobs`` entries in all (so only the top k−1 when the sampled
    token is outside the top k). Under ``as_ids`` tokens are named ``token_id:N``; the
    sampled token's ``bytes`` stay those of its text, its alternatives' are those of the name
    (as vLLM does)."""
    names = ContextNames()
    items = []
    for token in tokens:
        others = [(t, lp, names.name(t)) for t, lp in token.top if t.id != token.token.id][: max(top_logprobs - 1, 0)]
        name = names.advance(token.token)
        listed = [(_shown(token.token, name, as_ids), token.logprob), *((_shown(t, n, as_ids), lp) for t, lp, n in others)]
        items.append(
            {
                "token": listed[0][0],
                "logprob": token.logprob,
                "bytes": list(name.encode()),
                "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in listed]
                if top_logprobs
                else [],
            }
        )
    return items


def _shown(info: TokenInfo, name: str, as_ids: bool) -> str:
    return f"token_id:{info.id}" if as_ids else name


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
