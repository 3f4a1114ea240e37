"""Parse and order semantic version strings."""

from semverlite.compare import compare, max_version
from semverlite.version import Version, parse

__all__ = ["Version", "compare", "max_version", "parse"]
