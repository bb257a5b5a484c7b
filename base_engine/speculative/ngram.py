"""Prompt-lookup proposer (n-gram speculation): match the last n tokens of a request against its
own prompt and output, and propose the tokens that followed the most recent earlier match.

Longest n first (a longer match is likelier to continue the same way); no model, no state.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.max_n = max_n
        self.min_n = min_n

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        num = len(tokens)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = list(tokens[num - n :])
            # Latest start i < num - n with tokens[i:i+n] == suffix that has something after it.
            for i in range(num - n - 1, -1, -1):
                if tokens[i] == suffix[0] and list(tokens[i : i + n]) == suffix:
                    return list(tokens[i + n : min(i + n + k, num)])
        return []
