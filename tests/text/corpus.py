"""Documents of real text made from what a Debian machine holds (nothing downloaded).

The licences in /usr/share/common-licenses, and the packages' Debian changelogs
(/usr/share/doc/*/changelog.Debian.gz), one document an entry: English prose, code, e-mail
addresses and the names of people from many countries (non-ASCII text). `documents()` adds the
edge cases a tokenizer must get right: an empty document, whitespace alone, runs of spaces and
newlines, digits, a special token's text inside a document, text in scripts other than Latin.
"""

from __future__ import annotations

import gzip
import pathlib
import re

EDGE_CASES = [
    "",
    " ",
    "\n\n\n",
    "   leading and trailing spaces   ",
    "tabs\tand\r\nwindows line ends\r\n",
    "numbers 1234567 3.14159 2026-12-02 007",
    "<|endoftext|>a special token inside<|endoftext|><|endoftext|> text",
    "Ünïcödé: naïve café, Straße, Ærøskøbing, Łódź, İstanbul",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, 日本語のテキスト, 中文文本, 한국어",
    "emoji 🙂🚀 and symbols ∑∫√ ← → ©®™ and a zero-width\u200bjoiner",
    "it's we're they've I'm you'll he'd IT'S WE'RE",
    "x" * 3000,
    "     \n     \n",
]


def _changelog_entries(path: pathlib.Path) -> list[str]:
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return []
    # An entry starts at a line "package (version) distribution; urgency=...".
    parts = re.split(r"\n(?=\S+ \([^)]*\) [^;\n]*; urgency=)", text)
    return [p.strip("\n") for p in parts if p.strip()]


def documents(max_changelogs: int = 400) -> list[str]:
    """The corpus: licences, changelog entries (from up to `max_changelogs` packages), edge cases."""
    docs: list[str] = []
    for path in sorted(pathlib.Path("/usr/share/common-licenses").glob("*")):
        if path.is_file():
            try:
                docs.append(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                pass
    logs = sorted(pathlib.Path("/usr/share/doc").glob("*/changelog.Debian.gz"))[:max_changelogs]
    for path in logs:
        docs.extend(_changelog_entries(path))
    docs.extend(EDGE_CASES)
    return docs


if __name__ == "__main__":
    d = documents()
    nonascii = sum(1 for x in d if not x.isascii())
    print(f"{len(d)} documents, {sum(len(x.encode()) for x in d)} bytes, {nonascii} with non-ASCII text")
