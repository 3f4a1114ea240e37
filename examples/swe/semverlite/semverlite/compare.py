"""Ordering of version strings."""

from collections.abc import Iterable

from semverlite.version import parse


def _key(text: str) -> tuple[tuple[str, ...], bool, str]:
    # A pre-release sorts before its release: False < True.
    version = parse(text)
    core = f"{version.major}.{version.minor}.{version.patch}"
    return tuple(core.split(".")), version.prerelease == "", version.prerelease


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as version `a` is older than, the same as, or newer than `b`."""
    key_a, key_b = _key(a), _key(b)
    return (key_a > key_b) - (key_a < key_b)


def max_version(versions: Iterable[str]) -> str:
    """The newest of `versions`."""
    return max(versions, key=_key)
