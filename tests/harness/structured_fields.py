"""An RFC 8941 (Structured Field Values for HTTP) Dictionary reader of the tests' own, as an oracle for
headers the server writes."""

from __future__ import annotations

import re
from typing import Any


def parse_dictionary(value: str) -> dict[str, Any]:
    """An RFC 8941 Dictionary of bare items (strings, integers, booleans), as section 4.2 reads it."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(value):
        match = re.compile(r"[a-z*][a-z0-9_\-.*]*").match(value, i)
        assert match, f"no key at {i}: {value[i:]!r}"
        key, i = match.group(), match.end()
        assert value[i] == "=", f"{key} has no value"
        i += 1
        if value[i] == '"':
            chars, i = [], i + 1
            while value[i] != '"':
                if value[i] == "\\":
                    i += 1
                assert 0x20 <= ord(value[i]) < 0x7F, f"not printable ASCII in {key}"
                chars.append(value[i])
                i += 1
            item: Any = "".join(chars)
            i += 1
        elif value[i] == "?":
            item, i = value[i + 1] == "1", i + 2
        else:
            number = re.compile(r"-?\d{1,15}").match(value, i)
            assert number, f"{key}: not an integer at {value[i:]!r}"
            item, i = int(number.group()), number.end()
        out[key] = item
        if i < len(value):
            assert value[i : i + 2] == ", ", f"members must be separated by ', ' at {value[i:]!r}"
            i += 2
    return out
