"""Counter-based randomness for seeded sampling: a token's uniform is a pure function of
(request seed, absolute token position).

A generator that advances once per call would tie a request's tokens to how many draws it made
before, so scoring several positions in one step (speculative verification) or redrawing a rejected
position would shift every later token. Here position ``t`` of a request always gets the same
U[0, 1), whatever the batch, the step or the number of positions scored at once.

The mix is splitmix64 (Steele, Lea and Flood 2014) applied twice: once to the seed, once to that
result xor the position, which decorrelates neighbouring seeds and neighbouring positions.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (any int; reduced to 64 bits)."""
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """U[0, 1) with 53 random bits for the token at absolute ``position`` (prompt + output index)."""
    return (splitmix64(splitmix64(seed) ^ (position & _MASK)) >> 11) * 2.0**-53
