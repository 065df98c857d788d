"""The summed KL divergence (attnlab.fast.loss) against PyTorch's, value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.fast import loss as loss_module
from attnlab.fast.loss import summed_kl_divergence

# ---------------------------------------------------------------------------- KL divergence


def _torch_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The reference: F.kl_div of the two whole log-softmaxes, as distillation computed it."""
    return F.kl_div(
        F.log_softmax(student / temperature, -1),
        F.log_softmax(teacher / temperature, -1),
        reduction="sum",
        log_target=True,
    )


@pytest.mark.parametrize("temperature", [1.0, 2.0, 3.5])
def test_kl_value_and_both_gradients_equal_torch_kl_div(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loss_module, "_BLOCK_ELEMENTS", 4000)  # blocks of 4 rows of 1,000
    g = torch.Generator().manual_seed(3)
    student = (torch.randn(30, 1000, generator=g, dtype=torch.float64) * 3).requires_grad_()
    teacher = (torch.randn(30, 1000, generator=g, dtype=torch.float64) * 5).requires_grad_()
    ours = summed_kl_divergence(student, teacher, temperature)
    (ours * 0.37).backward()
    ours_grads = student.grad, teacher.grad
    student.grad = teacher.grad = None
    theirs = _torch_kl(student, teacher, temperature)
    (theirs * 0.37).backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours_grads[0], student.grad, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(ours_grads[1], teacher.grad, rtol=1e-10, atol=1e-15)


def test_kl_gradcheck_and_zero_for_equal_distributions() -> None:
    g = torch.Generator().manual_seed(4)
    args = [torch.randn(5, 11, generator=g, dtype=torch.float64, requires_grad=True)]
    args.append(torch.randn(5, 11, generator=g, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda s, t: summed_kl_divergence(s, t, 1.7), args)
    same = args[0].detach() + 2.5  # a shift per row leaves the softmax unchanged
    assert float(summed_kl_divergence(args[0].detach(), same, 2.0)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_kl_of_bf16_logits_is_the_fp32_kl_with_bf16_gradients(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the cross-entropy: widened a block at a time (T = 3 divides in fp32, not in bf16)
    monkeypatch.setattr(loss_module, "_BLOCK_ELEMENTS", 3000)
    g = torch.Generator().manual_seed(5)
    student = (torch.randn(rows, 1000, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    teacher = (torch.randn(rows, 1000, generator=g) * 3).to(torch.bfloat16)
    ours = summed_kl_divergence(student, teacher, 3.0)
    ours.backward()
    ours_grad, student.grad = student.grad, None
    theirs = _torch_kl(student.float(), teacher.float(), 3.0)
    theirs.backward()
    assert ours.dtype == torch.float32 and ours_grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # equal up to one bf16 rounding step (fp32 sums an ulp apart can round either way)
    torch.testing.assert_close(ours_grad, student.grad, rtol=2**-7, atol=1e-7)


def test_kl_second_backward_no_rows_and_shape_check() -> None:
    student, teacher = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    loss = summed_kl_divergence(student, teacher, 2.0)
    loss.backward(retain_graph=True)
    first, student.grad = student.grad, None
    loss.backward()
    torch.testing.assert_close(student.grad, first, rtol=0, atol=0)
    empty = torch.zeros(0, 5, requires_grad=True)
    loss = summed_kl_divergence(empty, torch.zeros(0, 5), 2.0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and empty.grad.shape == (0, 5)
    with pytest.raises(AttnlabError, match="rows, vocab"):
        summed_kl_divergence(student, torch.randn(3, 6))


def test_fast_twins_equal_the_plain_loss_modules() -> None:
    """BlockedKLDivergence against SummedKLDivergence."""
    from attnlab.fast.loss import BlockedKLDivergence
    from attnlab.nn.loss import SummedKLDivergence

    g = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(9, 40, generator=g), torch.randn(9, 40, generator=g)
    pairs = [(SummedKLDivergence(), BlockedKLDivergence(), lambda m, z: m(z, teacher, 1.5))]
    for plain, twin, call in pairs:
        grads = []
        for module in (plain, twin):
            z = logits.clone().requires_grad_(True)
            value = call(module, z)
            value.backward()
            grads.append((value.detach(), z.grad))
        torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)
    with pytest.raises(AttnlabError, match="rows, vocab"):
        SummedKLDivergence()(logits, torch.randn(9, 41))
