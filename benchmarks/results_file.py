"""``benchmarks/RESULTS.md`` is written by several scripts, each into its own marked section."""

from __future__ import annotations

import os


def write_section(path: str, name: str, section: str) -> None:
    """Put ``section`` between the ``<!-- NAME:begin -->`` / ``<!-- NAME:end -->`` markers of ``path`` (appended the
    first time), leaving the rest of the file as it is."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(text)
