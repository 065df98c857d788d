"""Decoding: greedy and beam search over the encoder-decoder Transformer, with a KV cache."""

from attnlab.decode.cache import KVBuffer, KVCache
from attnlab.decode.search import *  # noqa: F403  (replaced in the next step)

__all__ = ["KVBuffer", "KVCache"]
