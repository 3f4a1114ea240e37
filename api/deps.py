"""Route dependencies."""

from __future__ import annotations

from fastapi import Request

from api.service import Services


def services(request: Request) -> Services:
    """The gateway's services, built once in `create_app`."""
    svc: Services = request.app.state.services
    return svc
