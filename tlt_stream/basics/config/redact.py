"""Keeping secrets out of logs, errors and printed configurations."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["REDACTED", "SECRET_KEY", "is_secret_key", "redact_config", "redact_text", "redact_url"]


SECRET_KEY = r"[\w.-]*(?:pass(?:wd|word|phrase)?|pwd|token|secret|credentials?|auth|api[_-]?key|private[_-]?key)"
"""A setting or query parameter whose name ends in one of these holds a secret (`password`, `ssl_password`,
`passwd`, `pass`, `access_token`, `client_secret`, `auth`, `api_key`, ...; not `tokens` or `password_file`)."""

_SECRET_KEY_RE = re.compile(rf"^{SECRET_KEY}$", re.IGNORECASE)
_USERINFO_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/'\"]*):[^\s'\"]*@")
_WHOLE_USERINFO_RE = re.compile(r"^(?P<head>[\[('\"]*[A-Za-z][A-Za-z0-9+.-]*://[^:@/]*):.*@", re.DOTALL)
_WHOLE_BARE_USERINFO_RE = re.compile(r"^(?P<head>[\[('\"]*[A-Za-z][A-Za-z0-9+.-]*://)[^:/]*@")
_BARE_USERINFO_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)[^\s:/'\"\[\]]+@")
_ASSIGNMENT_RE = re.compile(rf"(?P<head>(?<![\w.-]){SECRET_KEY}=)[^\s&#;'\"]*", re.IGNORECASE)
REDACTED = "***"


def redact_text(text: str) -> str:
    """`text` with every secret it may carry replaced by `***`: URL passwords (`scheme://user:PASSWORD@host`,
    the password reaching to the last `@` of the URL, so an unescaped `@` or `/` in it hides nothing), a user
    part without a colon whole (`redis://SECRET@host`: redis-cli reads it as the password) and password-like
    assignments (`?password=...`, `&token=...`, `--set bus.x_secret=...`)."""
    text = _USERINFO_RE.sub(rf"\g<head>:{REDACTED}@", text)
    text = _BARE_USERINFO_RE.sub(rf"\g<head>{REDACTED}@", text)
    return _ASSIGNMENT_RE.sub(rf"\g<head>{REDACTED}", text)


def redact_url(url: str | None) -> str | None:
    """The URL with its password and any password-like query parameter replaced by `***`, for logs and
        error messages; never raises, whatever the URL. The text is one value (a setting's, a flag's), so its
        password reaches to the last `@` whatever it holds: a space or a quote in it hides nothing either. A user
    part without a colon is hidden whole, as redis-cli reads it as the password."""
    if url is None:
        return None
    url = _WHOLE_USERINFO_RE.sub(rf"\g<head>:{REDACTED}@", url)
    return redact_text(_WHOLE_BARE_USERINFO_RE.sub(rf"\g<head>{REDACTED}@", url))


def redact_config(tree: Any) -> Any:
    """A copy of a configuration tree (builtins, as `msgspec.to_builtins(config)` gives) fit to print:
    password-like keys hold `***`, and every string value (URLs among them) has its secrets redacted."""
    if isinstance(tree, dict):
        return {
            key: REDACTED if _SECRET_KEY_RE.match(str(key)) and value not in (None, "") else redact_config(value)
            for key, value in tree.items()
        }
    if isinstance(tree, list | tuple):
        return [redact_config(value) for value in tree]
    return redact_url(tree) if isinstance(tree, str) else tree


def is_secret_key(name: str) -> bool:
    """Whether a setting or parameter of this name holds a secret."""
    return bool(_SECRET_KEY_RE.match(name))
