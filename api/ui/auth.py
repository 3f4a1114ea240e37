"""Who may use the console, and protection of its state-changing forms.

The console takes the API's tokens: a bearer header, or the token kept in an HttpOnly,
SameSite=Strict cookie set by the sign-in form (Secure when the console is reached over
HTTPS, directly or through a proxy that says so in `X-Forwarded-Proto`); both are checked by
`api.deps.caller_of`. A tenant sees only its own batches and rollouts; the fleet pages are the
admin's (the operator's token).
Every POST must come from the console itself: an `Origin` (when the browser sends one) of
this host, and a form field `csrf` equal to the console's CSRF cookie (double submit: a page
of another site can neither read that cookie nor set it).
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, Response
from fastapi.security import HTTPAuthorizationCredentials

from api.deps import Caller, caller_of, services

TOKEN_COOKIE = "rollserve_token"
CSRF_COOKIE = "rollserve_csrf"
COOKIE_PATH = "/ui"


class SignInRequired(Exception):
    """The request carries no valid token; the console answers with its sign-in form."""


class AdminRequired(Exception):
    """A tenant asked for a page of the fleet; the console answers 403."""


def credentials_of(request: Request) -> HTTPAuthorizationCredentials | None:
    """The bearer token of the request's header, else the one in the console's cookie."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip())
    cookie = request.cookies.get(TOKEN_COOKIE)
    if cookie:
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=cookie)
    return None


def console_user(request: Request) -> Caller:
    """Who the request signs in as; SignInRequired without a valid token."""
    who = caller_of(services(request).settings, credentials_of(request))
    if who is None:
        raise SignInRequired
    return who


def console_admin(request: Request) -> Caller:
    """The caller, when it is the admin; AdminRequired for a tenant."""
    who = console_user(request)
    if not who.admin:
        raise AdminRequired
    return who


def is_https(request: Request) -> bool:
    """Whether the browser reached the console over HTTPS: the request's own scheme, or the
    first `X-Forwarded-Proto` of a TLS-terminating proxy in front of the gateway. (A client
    that lies about it only makes its own cookies Secure.)"""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def csrf_token(request: Request) -> str:
    """The console's CSRF token of this browser (a new one when it has none yet)."""
    token = request.cookies.get(CSRF_COOKIE)
    if token and 16 <= len(token) <= 128:
        return token
    token = getattr(request.state, "new_csrf", None)
    if token is None:
        token = request.state.new_csrf = secrets.token_urlsafe(24)
    return str(token)


def set_csrf_cookie(request: Request, response: Response) -> None:
    """Hand the browser the CSRF token its page was rendered with, if it is new."""
    token = getattr(request.state, "new_csrf", None)
    if token is not None:
        response.set_cookie(
            CSRF_COOKIE,
            token,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=is_https(request),
        )


def same_origin(request: Request) -> bool:
    """Whether the request's `Origin` (or, without one, its `Referer`) names this host; a
    request with neither is taken as not sent by a page of another site."""
    source = request.headers.get("origin") or request.headers.get("referer")
    if not source:
        return True
    if source == "null":
        return False
    host = request.headers.get("host", "")
    return urlsplit(source).netloc == host


def check_post(request: Request, fields: dict[str, str]) -> None:
    """403 for a console POST from another site or without the page's CSRF token."""
    if not same_origin(request):
        raise HTTPException(403, "cross-site request refused: its Origin is not this console")
    cookie = request.cookies.get(CSRF_COOKIE, "")
    given = fields.get("csrf", "")
    if not cookie or not secrets.compare_digest(cookie.encode(), given.encode()):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
