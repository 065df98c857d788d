"""The list of speed-ups (fast/swap.py: Speedup), one entry per twin or trainer measure."""

from __future__ import annotations

from torch import nn

from attnlab.fast.attention import (
    FastEncoder,
    FastEncoderLayer,
    FastMultiHeadAttention,
    UnpaddedEncoder,
)
from attnlab.fast.decoding import DecodingGPT, DecodingGPTBlock
from attnlab.fast.dropout import FastDropout
from attnlab.fast.linear import FastGPT, FastMLMHead, FastTransformer, TrainingLinear
from attnlab.fast.loss import BlockedKLDivergence
from attnlab.fast.swap import INFERENCE, TRAINING, Speedup
from attnlab.fast.training import TRAINER_SPEEDUPS
from attnlab.models.bert import BertMLMHead
from attnlab.models.gpt import GPT, GPTBlock
from attnlab.models.seq2seq import Transformer
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.blocks import Encoder, EncoderLayer
from attnlab.nn.loss import SummedKLDivergence


def _always() -> bool:
    return True


SPEEDUPS: list[Speedup] = [
    # Linear layers, dropout, losses and the trainer's measures (fast/linear.py, dropout.py,
    # loss.py, training.py).
    Speedup(
        "linear", nn.Linear, TrainingLinear, (TRAINING,), _always,
        "CPU fp32 training products by oneDNN where it trains faster (AMD with AVX-512); bf16 "
        "autocast's products by the fp32 kernel where bf16 is not fast",
    ),
    Speedup(
        "dropout", nn.Dropout, FastDropout, (TRAINING,), _always,
        "CPU dropout masks from four 16-bit integers per 64-bit draw, one masked pass",
    ),
    Speedup(
        "tied_projection", BertMLMHead, FastMLMHead, (TRAINING,), _always,
        "BERT's tied vocabulary projection by the linear twin's routes (bf16 by the fp32 "
        "kernel where bf16 is not fast)",
    ),
    Speedup(
        "tied_projection", Transformer, FastTransformer, (TRAINING,), _always,
        "the Transformer's tied output projection, likewise",
    ),
    Speedup(
        "tied_projection", GPT, FastGPT, (TRAINING,), _always,
        "GPT's LM head, likewise",
    ),
    Speedup(
        "kl_divergence", SummedKLDivergence, BlockedKLDivergence, (TRAINING,), _always,
        "CPU distillation KL a block of rows at a time, no whole log-softmaxes kept",
    ),
    *TRAINER_SPEEDUPS,  # not modules: given to the trainer (fast/training.py)
    # Attention and the encoder stack (fast/attention.py).
    Speedup(
        "attention", MultiHeadAttention, FastMultiHeadAttention, (TRAINING, INFERENCE), _always,
        "CPU attention by the explicit formula for few queries and with dropout, training "
        "dropout attention as one autograd function, beams sharing cross-attention keys",
    ),
    Speedup(
        "kept_rows", EncoderLayer, FastEncoderLayer, (TRAINING,), _always,
        "an encoder layer can compute some positions only (with the kept_rows encoder)",
    ),
    Speedup(
        "kept_rows", Encoder, FastEncoder, (TRAINING,), _always,
        "with BertModel's keep, the last layer computes only the kept positions",
    ),
    Speedup(
        "unpadded", Encoder, UnpaddedEncoder, (INFERENCE,), _always,
        "in evaluation with BertModel's keep, no layer computes padding: the position-wise "
        "parts run on the real tokens only",
    ),
    # Sampling (fast/decoding.py).
    Speedup(
        "decode_step", GPTBlock, DecodingGPTBlock, (INFERENCE,), _always,
        "a GPT block's cached one-token step in evaluation by direct function calls, without "
        "its dozen module calls",
    ),
    Speedup(
        "decode_model", GPT, DecodingGPT, (INFERENCE,), _always,
        "GPT's cached one-token step without padding: its blocks' steps called directly, only "
        "the position hooks its scheme fills",
    ),
]  # fmt: skip
