"""One scrubber for an upstream's API key, in every encoding the key can come back in (issue 33).

An upstream echoing the key in an error (a 401 that quotes the request) must not pass it to the client, status, why,
the metrics or the log. Replacing the raw key was not enough: `sk-TEST+KEY/abc=` came back URL-encoded as
`sk-TEST%2BKEY%2Fabc%3D`. The forms looked for: the raw key; JSON-escaped (with `\\/` or not, `\\uXXXX` for non-ASCII);
URL-encoded (`quote` and `quote_plus`, upper- and lower-case hex); and base64 (standard and URL-safe) at each of the
three alignments the key can start at inside a longer encoded header (`Basic`, a token wrapping it).
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import quote, quote_plus

MASK = "***"
MIN_BASE64 = 8  # a shorter stable run of base64 could match unrelated text


def _url_forms(key: str) -> set[str]:
    forms = {quote(key, safe=""), quote_plus(key, safe=""), quote(key)}
    return forms | {re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), f) for f in forms}


def _json_forms(key: str) -> set[str]:
    ascii_form = json.dumps(key)[1:-1]
    return {ascii_form, ascii_form.replace("/", "\\/"), json.dumps(key, ensure_ascii=False)[1:-1]}


def _base64_forms(key: str) -> set[str]:
    """The part of the key's base64 that does not depend on the bytes around it, at offsets 0, 1 and 2 mod 3."""
    raw, forms = key.encode(), set()
    for offset in range(3):
        padded = b"\0" * offset + raw
        whole = len(padded) // 3 * 4  # characters made of whole 3-byte groups
        start = 4 if offset else 0  # the first group mixes the unknown bytes before the key
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            stable = encode(padded)[start:whole].decode()
            if len(stable) >= MIN_BASE64:
                forms.add(stable)
    return forms


class Scrubber:
    """`text()` / `data()` with every form of the secret replaced by `***` (nothing to do without a secret)."""

    def __init__(self, secret: str | None) -> None:
        forms = set() if not secret else {secret} | _url_forms(secret) | _json_forms(secret) | _base64_forms(secret)
        ordered = sorted((f for f in forms if f), key=len, reverse=True)  # the longest first: no half-masked form
        self._text = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        encoded = [f.encode() for f in ordered]
        self._data = re.compile(b"|".join(map(re.escape, encoded))) if encoded else None
        self.longest = max(map(len, encoded), default=0)

    def text(self, text: str) -> str:
        return text if self._text is None else self._text.sub(MASK, text)

    def data(self, data: bytes) -> bytes:
        return data if self._data is None else self._data.sub(MASK.encode(), data)
