"""Route dependencies."""

from __future__ import annotations

import hashlib

from fastapi import Request

from api.service import Services


def services(request: Request) -> Services:
    """The gateway's services, built once in `create_app`."""
    svc: Services = request.app.state.services
    return svc


def tenant(request: Request) -> str:
    """Who submits: with `ROLLSERVE_API_TOKEN` set, a name derived from the (checked) bearer
    token, never the token itself; without it everyone is `anonymous`, so no client escapes
    the quota by inventing tokens. Quotas of unfinished jobs are kept per tenant."""
    if not services(request).settings.api_token:
        return "anonymous"
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "anonymous"
    return "token-" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
