"""``printable``: any value as one bounded line with every control character shown."""

from __future__ import annotations

import pytest

from snapshots.display import printable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("2026-11-28T02:11:29.000+00:00", "2026-11-28T02:11:29.000+00:00"),
        ("modèle épais · 模型", "modèle épais · 模型"),  # letters of any script stay
        ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # OSC: the terminal's title
        ("\x1b[2J\x9b2J", "\\x1b[2J\\x9b2J"),  # clear screen, by ESC [ and by C1 CSI
        ("a\tb\r\nc\x00\x7f", "a\\x09b\\x0d\\x0ac\\x00\\x7f"),  # every C0, and DEL
        ("\u202eevil\u2028", "\\u202eevil\\u2028"),  # a bidi override, a line separator
        ("bad\udcff", "bad\\udcff"),  # an undecodable byte (surrogateescape)
    ],
)
def test_every_unsafe_character_shows_as_its_escape(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_other_values_show_as_their_repr_and_never_fail() -> None:
    assert [printable(v) for v in (12, None, 1.5, ["\x1b"])] == ["12", "None", "1.5", "['\\x1b']"]
    assert printable(10**5000) == "<int>"  # too long for str(): shown by its type


def test_the_length_is_bounded_and_an_escape_never_split() -> None:
    assert printable("x" * 10_000, limit=20) == "x" * 17 + "..."
    assert printable("\x1b" * 100, limit=10) == "\\x1b..."
    assert printable("ok", limit=2) == "ok" and len(printable("\x1b" * 3, limit=8)) <= 8
