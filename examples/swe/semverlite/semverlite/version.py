"""Version strings: MAJOR.MINOR.PATCH with an optional -PRERELEASE, and a leading v allowed."""

import re
from dataclasses import dataclass

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?$")


@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: str = ""


def parse(text: str) -> Version:
    """The version `text` spells; ValueError when it is not one."""
    match = _VERSION.match(text.strip())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    major, minor, patch, prerelease = match.groups()
    return Version(int(major), int(minor), int(patch), prerelease or "")
