"""Text from outside (a checkpoint's manifest, a folder's file names) shown on a terminal:
its control characters escaped, so that what it holds is seen, never obeyed — an escape
sequence in a hostile file would otherwise move the cursor, clear or recolour the screen,
or a right-to-left mark reverse what follows it."""

from __future__ import annotations


def shown(text) -> str:
    """`text` (str() of it) with every character that is not printable — controls, format
    marks, line and paragraph separators, unassigned code points — as its Python escape
    (\\x1b, \\r, \\u202e); the space stays."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1]
                   for ch in str(text))
