"""Greedy word wrapping."""


def wrap(text: str, width: int) -> list[str]:
    """The words of `text` in lines of at most `width` characters (a longer word gets a
    line of its own)."""
    if width < 1:
        raise ValueError("width must be at least 1")
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
