"""Named defaults, one place for each (as httpx keeps ``DEFAULT_TIMEOUT_CONFIG``)."""

from __future__ import annotations

import httpx

SANDBOX_MODEL = "huggingfacetb/smollm2-135m-instruct"
"""The sandbox's model, and the one model the shipped ``verify.margin`` and mixture detection
rates were measured on (``benchmarks/verify_power.py`` on the sandbox's pools)."""
SANDBOX_HOST = "127.0.0.1"
SANDBOX_PORT = 8765
SANDBOX_MAX_BATCH = 32
"""Most requests of one precision decoding together (a lane, ``sandbox/sampler.py``): on 2
cores ~280 tok/s at 32 against ~22 at 1; the rest wait and join as rows finish."""
SANDBOX_STARTUP_TIMEOUT_S = 180.0
"""A first start converts the GGUF (~30 s on 2 cores); later starts take ~5 s."""
SANDBOX_API_KEY = "sk-quanthunt-sandbox"
"""The fixed key used against the sandbox when ``OPENROUTER_API_KEY`` is unset."""
SANDBOX_GENERATIONS_KEPT = 500_000
"""Generation records the sandbox keeps for ``/generation?id=`` before forgetting the oldest."""

# -- the gateway client --------------------------------------------------------------

GATEWAY_READ_TIMEOUT_S = 180.0
"""Reads wait long: a provider may take minutes for a long completion."""
GATEWAY_CONNECT_TIMEOUT_S = 10.0
GATEWAY_TIMEOUT = httpx.Timeout(connect=GATEWAY_CONNECT_TIMEOUT_S, read=GATEWAY_READ_TIMEOUT_S, write=30.0, pool=60.0)
"""The httpx client's (survey, verification, the reference); generation's aiohttp client
takes the same read and connect timeouts."""
GATEWAY_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=50)
"""For the survey and verification; generation uses its own transport for 2,000 in flight."""
GATEWAY_GET_ATTEMPTS = 4
"""Idempotent reads (endpoints, generation, key) are retried on transient failures."""
GATEWAY_GET_BACKOFF_S = 0.5
"""First retry delay of a read; doubles each time, capped at 10 s (Retry-After wins)."""
GATEWAY_UNREACHABLE_S = 5.0
"""Connections refused this long, with no reply in between, stop a generate run (exit 2):
nothing was sent, so nothing is lost, and retrying for minutes only hides the cause."""
GATEWAY_GENERATION_LAG_S = 5.0
"""``/generation?id=`` lags the reply (~1 s on OpenRouter): a 404 is asked again for this long."""
GATEWAY_SLOWEST_TOKENS_PER_S = 10.0
"""A chat reply may take its base read timeout plus ``max_tokens`` at this output rate
(a slow long answer is waited for, not abandoned and bought twice)."""

VLLM_STARTUP_TIMEOUT_S = 420.0
"""A real vLLM on 2 CPU cores is ready in ~50 s with --enforce-eager (150-220 s compiling)."""
VLLM_PORT = 8011
"""Where ``quanthunt reference vllm`` serves by default."""

# -- the reference -------------------------------------------------------------------

REFERENCE_RENDER_CONCURRENCY = 16
"""Chat templates rendered at the reference at once when validate counts every exported
turn's prompt tokens (``templates.count_prompts``): tokenizing is cheap, and 16 keeps a
shared reference's queue short."""
