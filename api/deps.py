"""Route dependencies: the gateway's services, and who calls.

With no token configured (`ROLLSERVE_API_TOKEN`, `ROLLSERVE_TENANT_TOKENS`) every caller is the
tenant `anonymous` and may do everything. With tokens, the operator's `ROLLSERVE_API_TOKEN`
(tenant `default`) is the admin: it alone changes the fleet (backends, weights) and sees every
tenant's work; any other token is a tenant that sees only its own batches and rollouts."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from fastapi import HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials

from api.service import Services
from core.settings import Settings

ADMIN_ONLY = "only the operator's token (ROLLSERVE_API_TOKEN) may do this"


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its tenant, and whether it holds the operator's token."""

    tenant: str
    admin: bool


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


def caller_of(
    settings: Settings, credentials: HTTPAuthorizationCredentials | None
) -> Caller | None:
    """The caller a bearer token makes (None for a missing or wrong one): without configured
    tokens an admin `anonymous`; with them, the admin only for `ROLLSERVE_API_TOKEN`."""
    who = tenant_of(settings, credentials)
    if who is None:
        return None
    if not settings.tokens():
        return Caller(who, admin=True)
    assert credentials is not None  # a tenant was found for it
    operator = settings.api_token or ""
    admin = secrets.compare_digest(credentials.credentials.encode(), operator.encode())
    return Caller(who, admin=admin)


def bearer_of(request: Request) -> HTTPAuthorizationCredentials | None:
    """The request's bearer token, if it carries one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip())
    return None


def caller(request: Request) -> Caller:
    """The request's caller, by its bearer token (401 without a valid one when tokens are
    configured; the routers check that first)."""
    found = caller_of(services(request).settings, bearer_of(request))
    if found is None:
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token (Authorization: Bearer <ROLLSERVE_API_TOKEN>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return found


def tenant(request: Request) -> str:
    """Who submits, for the quota of unfinished jobs and the ownership of what it submits:
    the tenant of the checked bearer token (`default` for ROLLSERVE_API_TOKEN), or
    `anonymous` without configured tokens, so no client escapes the quota by inventing
    tokens."""
    return tenant_of(services(request).settings, bearer_of(request)) or "anonymous"


def require_admin(request: Request) -> Caller:
    """The caller, when it holds the operator's token (or no token is configured); 403
    otherwise."""
    found = caller(request)
    if not found.admin:
        raise HTTPException(status_code=403, detail=ADMIN_ONLY)
    return found
