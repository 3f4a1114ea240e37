"""Conversions between camelCase and snake_case identifiers."""

import re

_UPPER_RUN = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def camel_to_snake(name: str) -> str:
    """`parseHttpHeader` -> `parse_http_header`."""
    return _UPPER_RUN.sub("_", name).lower()


def snake_to_camel(name: str) -> str:
    """`parse_http_header` -> `parseHttpHeader`."""
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)
