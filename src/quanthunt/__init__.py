"""quanthunt: audited training data from LLM API providers."""

from __future__ import annotations

__version__ = "0.1.0"
