"""The sampler's seeds: which seed each sample and each turn of a trajectory draws with.

torch's CPU generator keeps 32 bits of a seed, so seeds live in [0, 2**32). In a generate call
with base seed `base` the prompt at position i (its place in the step's global batch) gets seed
`(mix(base) + i * n) mod 2**32` and vLLM gives its sample k that seed + k: all samples of a call
have distinct seeds, calls with different bases use unrelated blocks (mix = splitmix64), and a
prompt's samples do not depend on which engine, or how many, generated it. Turn 0 of a
multi-turn trajectory draws the seed a single-turn sample at its place would; later turns draw
unrelated ones.
"""

from __future__ import annotations


def sample_seed(base: int, index: int) -> int:
    """The sampling seed of the sample at `index` (= position x n + k) of a call whose base seed
    is `base`: in [0, 2**32)."""
    return (mix64(base) % 2**32 + index) % 2**32


def turn_seed(base: int, turn: int, index: int) -> int:
    """The sampling seed of turn `turn` of trajectory `index` in a call with base seed `base`."""
    if turn == 0:
        return sample_seed(base, index)
    return sample_seed((base * 0x9E3779B1 + turn * 0x85EBCA77) % 2**63, index)


def mix64(x: int) -> int:
    """splitmix64: unrelated 64-bit values for consecutive inputs."""
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)
