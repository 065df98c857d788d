"""The settings of a search, in one dataclass with its checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnlab.errors import AttnlabError

# GNMT's alpha is about 0.6-1 in practice; ((5 + L) / 6) ** alpha overflows a float (an
# OverflowError) from about alpha 100 at a thousand tokens.
MAX_LENGTH_PENALTY = 50.0
MAX_BEAM = 1024  # beyond any useful search; a larger one only runs out of memory


@dataclass(frozen=True)
class SearchOptions:
    """How greedy and beam search run; the defaults are the paper's (section 6.1).

    ``beam_size`` 1 is greedy search. ``length_penalty`` is GNMT's alpha. Each sentence may
    emit at most ``int(max_len_a * src_len + max_len_b)`` tokens. ``use_cache=False`` re-runs
    the decoder over the whole prefix at every step (the reference path).
    """

    beam_size: int = 4
    length_penalty: float = 0.6
    max_len_a: float = 1.2
    max_len_b: float = 10
    use_cache: bool = True

    def __post_init__(self) -> None:
        """Refuse settings that give no real sentences."""
        if not 1 <= self.beam_size <= MAX_BEAM:
            raise AttnlabError(f"beam_size must be from 1 to {MAX_BEAM}, got {self.beam_size}")
        a, b = self.max_len_a, self.max_len_b
        # A one-token source must be allowed one output token: a + b >= 1 (NaN fails every test).
        if not (0 <= a < math.inf and 0 <= b < math.inf and a + b >= 1):
            raise AttnlabError(
                f"max_len_a and max_len_b must be finite, >= 0 and sum to at least 1 (got {a}, {b})"
            )
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:  # NaN fails too
            raise AttnlabError(
                f"length_penalty must be from {-MAX_LENGTH_PENALTY} to {MAX_LENGTH_PENALTY}, "
                f"got {self.length_penalty}"
            )
