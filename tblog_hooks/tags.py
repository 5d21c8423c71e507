"""TensorBoard tags: ``kind/part/...`` with user-data names escaped, so tags stay valid and unambiguous."""

from __future__ import annotations

import functools
from urllib.parse import unquote


@functools.lru_cache(maxsize=1 << 16)  # the same tags recur every logged step
def tag(kind: str, *parts: str) -> str:
    """``kind/part/...``; module and parameter names are user data, so each part is escaped
    (see :func:`escape`) and ``/`` only ever separates the parts."""
    return "/".join((kind, *map(escape, parts)))


def escape(name: str) -> str:
    """Percent-encode ``%``, ``/`` and unprintable characters (as UTF-8 bytes, as in URLs);
    other characters, unicode and spaces included, stay as they are.
    :func:`unescape` gives the name back.

    >>> escape("blocks.a/b 50%")
    'blocks.a%2Fb 50%25'
    """
    if name.isprintable() and "/" not in name and "%" not in name:
        return name
    return "".join(c if c.isprintable() and c not in "%/" else _percent(c) for c in name)


def _percent(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))


def unescape(part: str) -> str:
    """The name :func:`escape` was given."""
    return unquote(part, errors="surrogatepass")
