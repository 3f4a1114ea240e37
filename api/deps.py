"""Route dependencies."""

from __future__ import annotations

import secrets

from fastapi import Request
from fastapi.security import HTTPAuthorizationCredentials

from api.service import Services
from core.settings import Settings


def services(request: Request) -> Services:
    """The gateway's services, built once in `create_app`."""
    svc: Services = request.app.state.services
    return svc


def tenant_of(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> str | None:
    """The tenant a request's bearer token names, `anonymous` when no token is configured, or
    None for a missing or wrong token. Every configured token is compared in constant time."""
    tokens = settings.tokens()
    if not tokens:
        return "anonymous"
    if credentials is None:
        return None
    given = credentials.credentials.encode()
    found = None
    for token, name in tokens.items():
        if secrets.compare_digest(given, token.encode()):
            found = name
    return found


def tenant(request: Request) -> str:
    """Who submits, for the quota of unfinished jobs: the tenant of the checked bearer token
    (`default` for ROLLSERVE_API_TOKEN), or `anonymous` without configured tokens, so no
    client escapes the quota by inventing tokens."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    credentials = (
        HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip())
        if scheme.lower() == "bearer" and token.strip()
        else None
    )
    return tenant_of(services(request).settings, credentials) or "anonymous"
