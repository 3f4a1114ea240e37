"""URL slugs."""

import re
import unicodedata


def slugify(text: str, separator: str = "-") -> str:
    """The lower-case ASCII words of `text` joined by `separator`.

    Accents are dropped, punctuation is removed, and runs of spaces, underscores and
    dashes become one separator.
    """
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).lower()
    return re.sub(r"[\s_-]+", separator, text)
