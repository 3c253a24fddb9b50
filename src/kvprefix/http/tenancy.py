"""API keys, tenants, and the cache salt that keeps tenants from ever sharing a cached block.

A hit is faster, so a tenant that could hit another's blocks could probe what it sends. With keys, the namespace
in the root block hash comes from the authenticated tenant; a client ``cache_salt`` only subdivides its own
(docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvprefix.http.errors import APIError

DEFAULT_TENANT = "default"
_SALT_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def pseudonym(name: str) -> str:
    """A stable pseudonym for logs (tenants, users): the first 16 hex digits of SHA-256 of the name."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def validate_client_salt(salt: str | None) -> str | None:
    if salt is None:
        return None
    if not _SALT_RE.fullmatch(salt):
        raise APIError(
            400,
            "invalid 'cache_salt': use 1 to 64 characters from A-Z a-z 0-9 . _ : -",
            param="cache_salt",
        )
    return salt


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant (None when the server runs without keys) and the client's cache salt; the
    two pick the cache namespace (``cache.identity.namespace_salt``)."""

    tenant: str | None
    client_salt: str | None

    @property
    def tenant_label(self) -> str:
        return self.tenant or DEFAULT_TENANT


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Auth:
    """Maps API keys to tenants and guards the admin endpoints.

    No keys: one shared namespace, every caller accepted; admin endpoints open unless an admin key is set. Tenant
    keys without an admin key disable them: one tenant's cache reset would affect (and be timed by) all others.
    """

    def __init__(self, keys: dict[str, str] | None = None, admin_key: str | None = None):
        # Looked up by digest so that the dict probe never compares raw secrets.
        self._tenants = {_digest(k): t for k, t in (keys or {}).items()}
        self._admin = _digest(admin_key) if admin_key else None

    @classmethod
    def from_options(cls, api_key: str | None, api_keys_file: str | None, admin_key: str | None) -> Auth:
        """ValueError for options that ask for auth but configure none (an empty key or keys file), which would
        otherwise start a server open to everyone."""
        for option, key in (("--api-key", api_key), ("--admin-key", admin_key)):
            if key is not None and not key.strip():
                raise ValueError(f"{option} is empty (an unset variable?); give a key, or leave the option out")
        keys: dict[str, str] = {}
        if api_key is not None:
            keys[api_key] = DEFAULT_TENANT
        if api_keys_file is not None:
            keys |= load_keys_file(api_keys_file)
        return cls(keys, admin_key)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @property
    def has_admin_key(self) -> bool:
        return self._admin is not None

    @property
    def num_tenants(self) -> int:
        return len(set(self._tenants.values()))

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant, or None without tenancy. Raises 401 for a missing or unknown key."""
        if not self._tenants:
            return None
        token = _bearer(authorization)
        if token is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", type="authentication_error")
        tenant = self._tenants.get(_digest(token))
        if tenant is None:
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return tenant

    def check_admin(self, authorization: str | None) -> None:
        """For every endpoint that shows or affects all tenants: cache reset, KV events, /metrics."""
        if self._admin is None:
            if self._tenants:
                raise APIError(403, "admin endpoints (cache reset, KV events, /metrics) are disabled when API keys "
                               "are set and no admin key is: start the server with --admin-key",
                               type="permission_error")
            return
        token = _bearer(authorization)
        if token is None or not hmac.compare_digest(_digest(token), self._admin):
            raise APIError(401, "admin endpoints need 'Authorization: Bearer <admin key>'", type="authentication_error")


def load_keys_file(path: str) -> dict[str, str]:
    """An API-keys file is a JSON object mapping each key to its tenant name."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read API-keys file {path}: {exc}") from None
    if not isinstance(data, dict) or not data or not all(
            isinstance(k, str) and isinstance(v, str) and k.strip() and v.strip() for k, v in data.items()):
        raise ValueError(f'API-keys file {path} must be a non-empty JSON object of non-empty strings: '
                         f'{{"<key>": "<tenant>"}}')
    return data
