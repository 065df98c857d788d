"""Decoding: greedy and beam search over the encoder-decoder Transformer, with a KV cache.

``sampling.py`` generates from a decoder-only LM (GPT): greedy, temperature, top-k, top-p.

``options.py`` holds the search settings (SearchOptions), ``cache.py`` the key/value cache and
its row moves, ``search.py`` the searches, ``batches.py`` decoding many batches at once.
"""

from attnlab.decode.batches import map_batches, translate_batches
from attnlab.decode.cache import HeadMajorKVBuffer, KVBuffer, KVCache
from attnlab.decode.options import MAX_BEAM, MAX_LENGTH_PENALTY, SearchOptions
from attnlab.decode.sampling import generate, top_k_filter, top_p_filter
from attnlab.decode.search import (
    beam_search,
    gnmt_length_penalty,
    greedy_search,
    keep_rows,
    top_k_rows,
    translate_ids,
)

__all__ = [
    "MAX_BEAM",
    "MAX_LENGTH_PENALTY",
    "HeadMajorKVBuffer",
    "KVBuffer",
    "KVCache",
    "SearchOptions",
    "beam_search",
    "generate",
    "gnmt_length_penalty",
    "greedy_search",
    "keep_rows",
    "map_batches",
    "top_k_filter",
    "top_k_rows",
    "top_p_filter",
    "translate_batches",
    "translate_ids",
]
