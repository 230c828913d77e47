"""The one base-URL check (``urls.check_base_url``) and the loopback test behind it, called
directly as the gateway, reference and sandbox call them. ``test_params_bad_inputs.py``
covers the same check through ``params.yaml`` (which URLs params accept or refuse, and that
a params error hides a password); here: what the check itself returns and says."""

from __future__ import annotations

import pytest

from quanthunt.urls import check_base_url, is_loopback

SECRET = "hunter2hunter2"


@pytest.mark.parametrize("host", ["localhost", "LocalHost", "127.0.0.1", "127.45.6.7", "::1", "[::1]", "0:0:0:0:0:0:0:1"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["", "0.0.0.0", "::", "10.0.0.1", "192.168.1.5", "localhost.example.com", "mylocalhost", "128.0.0.1", "[::2]"]
)
def test_hosts_that_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://openrouter.ai/api/v1/", "https://openrouter.ai/api/v1"),
        ("https://openrouter.ai/api/v1///", "https://openrouter.ai/api/v1"),
        ("https://openrouter.ai:443/api/v1", "https://openrouter.ai:443/api/v1"),
        ("http://[::1]:8000/v1/", "http://[::1]:8000/v1"),
        ("https://bücher.example/v1", "https://bücher.example/v1"),
    ],
)
def test_an_accepted_url_comes_back_without_its_trailing_slashes(url: str, expected: str) -> None:
    assert check_base_url(url) == expected


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://user:hunter2hunter2@openrouter.ai/api/v1", "must be an http(s) URL, got 'ftp://***@openrouter.ai/api/v1'"),
        ("http://user:hunter2hunter2@127.0.0.1:abc/v1", "is not a usable URL: 'http://***@127.0.0.1:abc/v1'"),
        ("https://user:hunter2hunter2@[::1/v1", "is not a usable URL: 'https://***@[::1/v1'"),
        ("https://user:hunter2#hunter2@openrouter.ai/v1", "is not a usable URL: 'https://***@openrouter.ai/v1'"),
        ("http://admin:hunter2hunter2@ex.com/v1", "plain http is only allowed to a loopback host; use https for ex.com"),
        ("https://admin:hunter2hunter2@openrouter.ai/v1", "must not carry credentials; the API key comes from the environment"),
    ],
)
def test_every_refusal_hides_the_user_and_password(url: str, problem: str) -> None:
    """Before the fix, the first three quoted the whole URL, password included, into the
    gateway's and reference's errors; the unclosed ``[`` gave urlsplit's bare 'Invalid IPv6
    URL'; and a password holding ``#`` escaped the params error's scrubbing."""
    with pytest.raises(ValueError) as info:
        check_base_url(url)
    message = str(info.value)
    assert message == problem
    assert "hunter2" not in message and "user" not in message and "admin" not in message


@pytest.mark.parametrize("url", ["https://@openrouter.ai/api/v1", "https://:@openrouter.ai/api/v1", "http://@localhost:8000/v1"])
def test_an_empty_user_part_is_refused_like_any_credentials(url: str) -> None:
    with pytest.raises(ValueError, match=r"^must not carry credentials"):
        check_base_url(url)


@pytest.mark.parametrize("url", [" https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1 ", "\thttps://openrouter.ai/v1"])
def test_spaces_around_the_url_are_refused(url: str) -> None:
    """urlsplit strips them and saw a good URL; the HTTP client keeps them, and a leading
    space made the base a relative path (``%20https://...``), so every request failed."""
    with pytest.raises(ValueError, match=r"^is not a usable URL \(spaces around it\)"):
        check_base_url(url)


def test_an_unprintable_url_is_quoted_on_one_line_and_cut() -> None:
    url = "gopher://example.com/\n" + "a" * 200
    with pytest.raises(ValueError) as info:
        check_base_url(url)
    message = str(info.value)
    assert message.splitlines() == [message] and "\\n" in message
    assert message.startswith("must be an http(s) URL, got 'gopher://example.com/\\\\na") and message.endswith("...'")
    assert len(message) <= 120
