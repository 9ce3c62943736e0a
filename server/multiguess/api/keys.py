"""API keys and the tenants they name: the key file's format and its checks.

A key file holds one key per line, optionally followed by the tenant the key belongs to
(``default`` when absent); blank lines and lines starting with ``#`` are skipped. Several keys
may name one tenant (a key being rotated); one key may not appear twice. A tenant is the unit
the prefix cache is scoped by: requests of one tenant may reuse each other's prompt KV, those
of different tenants never do. Errors name the file and line, never the key.

    # key                        tenant
    sk-9f2c61d0a4b7e3            acme
    sk-0b8e5d7c2a91f4            acme
    sk-6a1f03c9d2e8b5            globex
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")


def parse_keys(text: str, source: str) -> dict[str, str]:
    """The keys in a key file's ``text`` and their tenants (key -> tenant); ``source`` names
    the file in errors. A ValueError for a malformed line, a repeated key or no key at all."""
    keys: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{source}, line {number}"
        if len(fields) > 2:
            raise ValueError(f"{where}: expected 'KEY [TENANT]', got {len(fields)} fields")
        key, tenant = fields[0], fields[1] if len(fields) == 2 else DEFAULT_TENANT
        if not (key.isascii() and key.isprintable()):
            raise ValueError(f"{where}: a key must be printable ASCII (it travels in an HTTP header)")
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(
                f"{where}: tenant names are 1-64 letters, digits and . _ @ : -, starting with a "
                f"letter or digit; got {tenant!r}"
            )
        if key in keys:
            raise ValueError(f"{where}: the same key as line {first_line[key]}; each key names one tenant")
        keys[key], first_line[key] = tenant, number
    if not keys:
        raise ValueError(f"{source} holds no API key")
    return keys


def load_keys(path: str) -> dict[str, str]:
    """The keys of the key file at ``path`` (``parse_keys``)."""
    return parse_keys(Path(path).read_text(encoding="utf-8"), path)


def readable_by_others(path: str) -> bool:
    """Whether users other than the file's owner and group may read it (keys are secrets)."""
    return bool(Path(path).stat().st_mode & stat.S_IROTH)
