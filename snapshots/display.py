"""Text from a snapshot (or any file another party may write), made safe to print.

A manifest's ``created_at``, a file or tensor name, or an error quoting one, is whatever the
folder's writer put there: an escape sequence in it would reach the reader's terminal, which
may set its title, rewrite what was printed, or worse. ``printable`` shows every control
character as a visible escape instead, bounds the length, and takes any value.

Usable by every command-line reader (``elastic-train snapshots``, ``elastic-train status``):
it imports nothing but the standard library, and elastic_trainer may import it.
"""

from __future__ import annotations

import unicodedata

DEFAULT_LIMIT = 200
ELLIPSIS = "..."
# Control characters (C0, DEL, C1), format characters (bidirectional overrides that reorder
# what is shown, zero-width ones that hide text), line and paragraph separators, and lone
# surrogates (undecodable bytes, which printing would fail on).
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def printable(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """``value`` as one line of text that is safe to print to a terminal.

    A string is taken as it is, anything else as its ``repr`` (never an error, whatever the
    value). Every unsafe character (an escape sequence's ESC, BEL, CR, newline, DEL, C1
    codes, bidirectional overrides...) is replaced by its Python escape (``\\x1b``,
    ``\\u202e``), so what the text hides shows. At most ``limit`` characters come back; a
    longer text is cut and ends with ``...``.
    """
    text = value if isinstance(value, str) else _repr(value)
    out: list[str] = []
    size = 0
    for char in text[: limit + 1]:  # each character gives one or more: no more are needed
        piece = _escape(char)
        if size + len(piece) > limit:
            return _cut(out, limit)
        out.append(piece)
        size += len(piece)
    return "".join(out)


def _escape(char: str) -> str:
    if unicodedata.category(char) not in _UNSAFE:
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _cut(pieces: list[str], limit: int) -> str:
    """The whole pieces that fit in ``limit`` with the ellipsis (an escape is never split)."""
    room = max(limit - len(ELLIPSIS), 0)
    kept: list[str] = []
    for piece in pieces:
        if room < len(piece):
            break
        kept.append(piece)
        room -= len(piece)
    return ("".join(kept) + ELLIPSIS)[:limit]


def _repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:  # a repr that fails (an int too long for str) is still shown as a type
        return f"<{type(value).__name__}>"
