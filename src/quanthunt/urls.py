"""The base URLs quanthunt talks to, checked in one place: ``params.yaml`` (``api`` and
``reference``), the gateway and reference clients and the sandbox all use these."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

import httpx

from quanthunt.config_files import hide_userinfo, one_line

DEPLOYMENT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
"""A deployment's name: a path segment of the sandbox's ``/deployments/<name>`` and of
``calibrate.controls``' ``sandbox:<name>`` (and a control's own name)."""


def is_loopback(host: str) -> bool:
    """``localhost`` (any case) or a loopback address (``[::1]`` as a URL writes it, too)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_ledger_url(url: str) -> str:
    """``url`` when it names a ledger (``quanthunt.ledger``): ``sqlite:///relative/path``
    (under the project), ``sqlite:////absolute/path`` or ``postgresql://user@host:port/db``.
    Raises ``ValueError`` naming the problem, never quoting a password."""
    scheme, sep, rest = url.partition("://")
    sqlite_path = rest[1:] if scheme == "sqlite" and rest.startswith("/") else ""
    if not sep or not (sqlite_path.strip("/") or (scheme in ("postgresql", "postgres") and rest)) or "\x00" in url:
        shown = one_line(hide_userinfo(url), 80)
        raise ValueError(f"is not a ledger URL (sqlite:///path or postgresql://host/db): {shown!r}")
    return url


def check_base_url(url: str) -> str:
    """An https URL, or plain http to a loopback host (the sandbox, a local server), that
    the HTTP client reads as it is written (a numeric port in range, no credentials, no
    surrounding spaces).

    Raises ``ValueError`` naming the problem, never quoting a user or password; returns the
    URL without a trailing slash.
    """
    shown = one_line(hide_userinfo(url), 80)
    if url != url.strip():  # urlsplit strips the spaces, the HTTP client keeps them (a relative URL)
        raise ValueError(f"is not a usable URL (spaces around it): {shown!r}")
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed "[" of an IPv6 host
        raise ValueError(f"is not a usable URL: {shown!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL, got {shown!r}")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in range
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL):
        raise ValueError(f"is not a usable URL: {shown!r}") from None
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ValueError(f"plain http is only allowed to a loopback host; use https for {parts.hostname}")
    if "@" in parts.netloc:  # an empty user ("https://@host") too
        raise ValueError("must not carry credentials; the API key comes from the environment")
    return url.rstrip("/")
