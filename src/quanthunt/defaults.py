"""Named defaults, one place for each (as httpx keeps ``DEFAULT_TIMEOUT_CONFIG``)."""

from __future__ import annotations

SANDBOX_HOST = "127.0.0.1"
SANDBOX_PORT = 8765
SANDBOX_MAX_BATCH = 32
"""Requests of one precision sampled together (~60 tok/s at 32 vs ~7 at 1, 2 cores)."""
SANDBOX_BATCH_WINDOW_S = 0.01
"""How long the first waiting request waits for company before its batch starts."""
SANDBOX_STARTUP_TIMEOUT_S = 180.0
"""A first start converts the GGUF (~30 s on 2 cores); later starts take ~5 s."""
SANDBOX_API_KEY = "sk-quanthunt-sandbox"
"""The fixed key used against the sandbox when ``OPENROUTER_API_KEY`` is unset."""
SANDBOX_GENERATIONS_KEPT = 500_000
"""Generation records the sandbox keeps for ``/generation?id=`` before forgetting the oldest."""
MAX_TOP_LOGPROBS = 20
"""OpenRouter's and OpenAI's upper bound on ``top_logprobs``."""
