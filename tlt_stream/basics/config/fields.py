"""What every section of the configuration tree is made of: a frozen Struct that refuses unknown keys, a
docstring and constraints per field (`doc`), and the checks a field's own value needs."""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

from msgspec import Meta, Struct

from tlt_stream.basics.config.redact import redact_url

__all__ = ["ARM_LABEL", "DEVICE_PATTERN", "PositiveInt", "Section", "check_device", "check_url", "doc"]


def doc(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
PositiveInt = Annotated[int, Meta(ge=1)]
REDIS_SCHEMES = ("redis", "rediss", "unix")
MQTT_SCHEMES = ("mqtt", "mqtts")
ARM_LABEL = (
    r"^(plain|ngram-d[1-9][0-9]*|group-d[1-9][0-9]*v[1-9][0-9]*"
    r"|d[1-9][0-9]*k[1-9][0-9]*v[1-9][0-9]*(\+g[1-9][0-9]*)?|d[1-9][0-9]*k1v[1-9][0-9]*\|g[1-9][0-9]*)$"
)


def check_device(value: str, name: str) -> None:
    if not re.fullmatch(DEVICE_PATTERN, value):
        raise ValueError(f"{name} must be auto, cpu, cuda or cuda:N (got {value!r})")


def check_url(value: str | None, schemes: tuple[str, ...], name: str) -> None:
    """`value` must start with one of `schemes` and parse as a URL: a port that is a number, and nothing after
    the host that a password cut short would leave (a `#`, an `@`). A password with `/ # ? @ :` in it, not
    percent-encoded, would otherwise be split at that character and reach an error message or a host name;
    so the parse error names the setting and quotes nothing of the URL."""
    if value is None:
        return
    unparsable = ValueError(
        f"{name} does not parse as a URL; a password holding / # ? @ or : must be percent-encoded "
        "(/ as %2F, # as %23, ? as %3F, @ as %40, : as %3A)"
    )
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
        parts.hostname  # noqa: B018
    except ValueError:
        raise unparsable from None
    if parts.scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise ValueError(f"{name} must start with one of {allowed} (got {redact_url(value)!r})")
    if "#" in value or "@" in parts.path or "@" in parts.query:
        raise unparsable


class Section(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass
