"""generate (decode/sampling.py): the filters against hand-computed sets and HF's warpers,
greedy against an uncached argmax loop, seeds, eos, streaming, bad options."""

from __future__ import annotations

import math

import pytest
import torch
import transformers.generation.logits_process as hf_process

from attnlab.config import GPTConfig
from attnlab.decode.sampling import generate, next_tokens, top_k_filter, top_p_filter
from attnlab.errors import AttnlabError
from attnlab.models.gpt import GPT

VOCAB = 29


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_positions=24
    )
    return GPT(config).eval()


def kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.isfinite(filtered[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    ("p", "expected"),
    [(0.5, {0}), (0.79, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01]])
    order = torch.tensor([3, 0, 4, 1, 2])  # shuffled, so the set is found by probability
    logits = probs.log()[:, order]
    assert {int(order[i]) for i in kept(top_p_filter(logits, p))} == expected
    assert kept(top_p_filter(logits, 1.0)) == set(range(5))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.5]])
    assert kept(top_k_filter(logits, 2)) == {1, 3}
    assert kept(top_k_filter(logits, 1)) == {3}
    assert kept(top_k_filter(logits, 99)) == set(range(5))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_filters_equal_transformers_warpers(p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 2
    hf_p = hf_process.TopPLogitsWarper(p)(None, logits.clone())
    assert torch.equal(torch.isfinite(top_p_filter(logits, p)), torch.isfinite(hf_p))
    hf_k = hf_process.TopKLogitsWarper(7)(None, logits.clone())
    assert torch.equal(torch.isfinite(top_k_filter(logits, 7)), torch.isfinite(hf_k))


def test_sampling_draws_from_softmax_over_temperature():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]]).expand(40000, 4)
    gen = torch.Generator().manual_seed(0)
    drawn = next_tokens(logits, True, temperature=2.0, generator=gen)
    freq = torch.bincount(drawn, minlength=4).double() / len(drawn)
    expected = torch.softmax(logits[0].double() / 2.0, dim=0)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


def test_greedy_equals_an_uncached_argmax_loop(model):
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    out = generate(model, ids, 8, do_sample=False)
    expected = ids
    with torch.no_grad():
        for _ in range(8):
            step = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, step], 1)
    assert torch.equal(out, expected)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    ids = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))

    def sample(seed: int, **options) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, ids, 10, generator=gen, **options)

    assert torch.equal(sample(7, top_p=0.9, temperature=0.8), sample(7, top_p=0.9, temperature=0.8))
    assert not torch.equal(sample(7, temperature=1.5), sample(8, temperature=1.5))
    assert torch.equal(sample(7, top_k=1), generate(model, ids, 10, do_sample=False))


def test_a_row_stops_at_eos_and_is_padded_after(model):
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))
    free = generate(model, ids, 10, do_sample=False)
    eos = int(free[0, 6])  # row 0's third new token
    first_eos = [
        int((row[4:] == eos).nonzero()[0]) if (row[4:] == eos).any() else None for row in free
    ]
    out = generate(model, ids, 10, do_sample=False, eos_id=eos, pad_id=VOCAB - 1)
    stop0 = first_eos[0]
    assert torch.equal(out[0, : 4 + stop0 + 1], free[0, : 4 + stop0 + 1])
    assert (out[0, 4 + stop0 + 1 :] == VOCAB - 1).all()
    if first_eos[1] is None:  # row 1 runs on as it would without eos
        assert torch.equal(out[1], free[1])


def test_generation_ends_when_every_row_has_ended(model):
    ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(4))
    free = generate(model, ids, 10, do_sample=False)
    out = generate(model, ids, 10, do_sample=False, eos_id=int(free[0, 5]))
    assert out.shape[1] <= 6 and out[0, -1] == free[0, 5]


def test_on_token_streams_every_step(model):
    ids = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))
    seen = []
    out = generate(model, ids, 6, do_sample=False, on_token=lambda step, t: seen.append((step, t)))
    assert [step for step, _ in seen] == list(range(6))
    assert torch.equal(torch.stack([t for _, t in seen], 1), out[:, 3:])


def test_generate_leaves_the_model_mode(model):
    model.train()
    try:
        generate(model, torch.ones(1, 2, dtype=torch.long), 2)
        assert model.training
    finally:
        model.eval()


@pytest.mark.parametrize(
    "options",
    [
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"temperature": 0.0},
        {"temperature": -1.0},
        {"temperature": math.inf},
        {"top_k": 0},
        {"eos_id": VOCAB},
        {"max_new_tokens": -1},
        {"max_new_tokens": 21},  # past the context of 24 after 4 prompt tokens
        {"input_ids": torch.ones(1, 25, dtype=torch.long)},  # longer than the context
        {"attention_mask": torch.tensor([[1, 1, 1, 0]])},  # right padding
    ],
)
def test_bad_options_are_refused(model, options):
    args = {"input_ids": torch.ones(1, 4, dtype=torch.long), "max_new_tokens": 3, **options}
    with pytest.raises(AttnlabError):
        generate(model, args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_greedy_ignores_the_sampling_options(model):
    ids = torch.ones(1, 3, dtype=torch.long)
    greedy = generate(model, ids, 4, do_sample=False)
    assert torch.equal(generate(model, ids, 4, do_sample=False, temperature=0.0, top_p=5), greedy)
