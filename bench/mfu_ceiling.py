"""How high a pretraining step's utilisation could go: its operations timed in the step and alone.

Model FLOPs utilisation (MFU) is the model's FLOPs over the step's time and the machine's
matmul peak (bench/pretrain.py's count and peak). A step is its matrix products, the other
ATen operations (LayerNorm, GELU, softmax, dropout's multiplies, the loss, AdamW, copies) and
the rest (Python, the autograd engine, drawing dropout's masks). This measures, for attnlab's
training step (bench/pretrain.py's attnlab side):

1. the step: the fastest of --steps steps after two warm-up steps;
2. its operations in the step: every ATen operation timed as it runs, through a dispatch
   mode, products (mm, addmm, bmm, baddbmm, oneDNN's linear) apart from the others; the
   fastest of --steps steps counts for each group;
3. the same operations alone: in one more step, each operation run again --repeats times on
   copies of its own inputs, right after it ran (so with its data in cache), the fastest
   counting.

From these it prints the step's MFU; the ceiling if everything but the products took no time
(products at their in-step speed, and alone); the ceiling if every operation ran at its
standalone speed with no Python in between; and, for a target (--target, default 0.8), the
time the step allows everything that is not a product. Fastest times count throughout, as the
shared host's speed drifts by 10-20% within a minute; "the rest" is the fastest step less the
fastest products and other operations, each from its own step, so drift moves it most (it can
come out negative). The dispatch mode's own references to
tensors keep autograd from summing some gradients in place: under it, the tied embedding's
two gradients are summed into a new (vocab, width) tensor (about 8 ms at bert-small, against
about 1 ms for the in-place sum of the step without it), so "other" reads a little high.

Usage: python bench/mfu_ceiling.py [--preset bert-small] [--batch-size 32] [--seq-len 128]
       [--steps 5] [--precision fp32|bf16] [--threads T] [--repeats 3] [--target 0.8]
       [--top 12]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, matmul_peak_flops, peak_dtype, synthetic_batch
from pretrain import MASK_RATE, attnlab_step, must_do_flops

aten = torch.ops.aten
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
if hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    PRODUCTS.add(torch.ops.mkldnn._linear_pointwise.default)


def product_flops(func: Callable, args: tuple) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of one product call."""
    if func is aten.mm.default:
        (m, k), n = args[0].shape, args[1].shape[1]
        return 2 * m * k * n
    if func is aten.addmm.default:
        (m, k), n = args[1].shape, args[2].shape[1]
        return 2 * m * k * n
    if func in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    x, weight = args[0], args[1]  # oneDNN's linear: x (..., k), weight (n, k)
    return 2 * (x.numel() // x.shape[-1]) * x.shape[-1] * weight.shape[0]


def _copy(value: object) -> object:
    """A tensor's copy (same strides where they are dense), anything else as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


class OpTimer(TorchDispatchMode):
    """Times every ATen operation run inside it, products apart; optionally each one alone too.

    With ``repeats`` each operation runs that many more times on copies of its inputs (an
    in-place one thus leaves the step's tensors as they were) and its fastest run is added to
    ``alone``; an operation that cannot be rerun that way counts its in-step time there.
    """

    def __init__(self, repeats: int = 0) -> None:
        super().__init__()
        self.repeats = repeats
        self.in_step = {"products": 0.0, "other": 0.0}
        self.alone = {"products": 0.0, "other": 0.0}
        self.alone_by_op: Counter = Counter()  # other operations: name -> seconds alone
        self.flops = 0
        self.not_rerun = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run the op, timed (CPU ops finish before they return); then alone if asked."""
        kwargs = kwargs or {}
        kind = "products" if func in PRODUCTS else "other"
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        self.in_step[kind] += seconds
        if kind == "products":
            self.flops += product_flops(func, args)
        if self.repeats:
            fastest = math.inf
            try:
                for _ in range(self.repeats):
                    copies, kw = tree_map(_copy, args), tree_map(_copy, kwargs)
                    start = time.perf_counter()
                    func(*copies, **kw)
                    fastest = min(fastest, time.perf_counter() - start)
            except RuntimeError:  # e.g. an op whose inputs must alias each other
                fastest, self.not_rerun = seconds, self.not_rerun + 1
            self.alone[kind] += fastest
            if kind == "other":
                self.alone_by_op[func.__name__] += fastest
        return out


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bert-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--top", type=int, default=12, help="other operations listed")
    return parser.parse_args()


def time_step(step: Callable[[], None], steps: int, repeats: int) -> tuple:
    """(fastest step seconds, fastest in-step seconds of products and of other operations,
    product FLOPs executed a step, an OpTimer of each operation timed alone)."""
    step()
    step()
    step_s = math.inf
    for _ in range(steps):
        start = time.perf_counter()
        step()
        step_s = min(step_s, time.perf_counter() - start)
    in_step = {"products": math.inf, "other": math.inf}
    for _ in range(steps):
        with OpTimer() as timer:
            step()
        in_step = {kind: min(in_step[kind], timer.in_step[kind]) for kind in in_step}
    with OpTimer(repeats) as alone:
        step()
    return step_s, in_step, timer.flops, alone  # the same calls every step


def main() -> None:
    """Measure, print a summary and the largest other operations, then a JSON line."""
    args = parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.config import BertConfig
    from attnlab.fast.training import keep_freed_memory

    keep_freed_memory()  # as the trainer does
    torch.manual_seed(0)
    config = BertConfig.preset(args.preset)
    data = synthetic_batch(config.vocab_size, args.batch_size, args.seq_len, MASK_RATE)
    flops, _ = must_do_flops(config, data, args.batch_size, args.seq_len)
    yardstick = peak_dtype(args.precision)
    peak = matmul_peak_flops(yardstick)

    step = attnlab_step(config, data, args.precision)
    step_s, in_step, executed, alone = time_step(step, args.steps, args.repeats)
    peak = max(peak, matmul_peak_flops(yardstick))  # measured again after; the higher counts

    products_in, others_in = in_step["products"], in_step["other"]
    products_alone, others_alone = alone.alone["products"], alone.alone["other"]
    budget = flops / (args.target * peak)  # the step time the target allows
    result = {
        "bench": "mfu_ceiling", "preset": args.preset, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "precision": args.precision, "threads": args.threads,
        "peak_gflops": peak / 1e9, "model_gflop": flops / 1e9,
        "product_gflop_executed": executed / 1e9, "step_s": step_s,
        "products_in_step_s": products_in, "other_ops_in_step_s": others_in,
        "rest_s": step_s - products_in - others_in,
        "products_alone_s": products_alone, "other_ops_alone_s": others_alone,
        "ops_not_rerun": alone.not_rerun,
        "mfu": flops / (step_s * peak),
        "ceiling_products_in_step": flops / (products_in * peak),
        "ceiling_products_alone": flops / (products_alone * peak),
        "ceiling_all_ops_alone": flops / ((products_alone + others_alone) * peak),
        "target": args.target, "other_s_allowed_in_step": budget - products_in,
        "other_s_allowed_alone": budget - products_alone,
    }  # fmt: skip
    print_summary(result, executed, alone, args.top)
    print(json.dumps(result))


def print_summary(result: dict, executed: float, alone: OpTimer, top: int) -> None:
    """The step's time split, the ceilings and the largest other operations, to stderr."""
    ms, peak, step_s = 1e3, result["peak_gflops"] * 1e9, result["step_s"]
    products_in, others_in = result["products_in_step_s"], result["other_ops_in_step_s"]
    products_alone, others_alone = result["products_alone_s"], result["other_ops_alone_s"]
    budget = result["model_gflop"] * 1e9 / (result["target"] * peak)
    print(f"machine: {machine()}; matmul peak {peak / 1e9:.1f} GFLOP/s", file=sys.stderr)
    print(
        f"step {step_s * ms:.0f} ms, MFU {result['mfu']:.1%}\n"
        f"  in the step: products {products_in * ms:.0f} ms "
        f"({executed / products_in / 1e9:.0f} GFLOP/s), other ATen operations "
        f"{others_in * ms:.0f} ms, the rest (Python, autograd, dropout masks) "
        f"{result['rest_s'] * ms:.0f} ms\n"
        f"  each operation alone: products {products_alone * ms:.0f} ms "
        f"({executed / products_alone / 1e9:.0f} GFLOP/s), other ATen operations "
        f"{others_alone * ms:.0f} ms\n"
        f"ceilings: products alone in the step {result['ceiling_products_in_step']:.1%}, "
        f"products at their standalone speed {result['ceiling_products_alone']:.1%}, every "
        f"operation at its standalone speed and nothing else {result['ceiling_all_ops_alone']:.1%}"
        f"\nMFU {result['target']:.0%} allows {budget * ms:.0f} ms a step: "
        f"{result['other_s_allowed_in_step'] * ms:.0f} ms for all but the products at their "
        f"in-step speed, {result['other_s_allowed_alone'] * ms:.0f} ms at their standalone speed",
        file=sys.stderr,
    )
    print("largest other operations, alone (ms a step):", file=sys.stderr)
    for name, seconds in alone.alone_by_op.most_common(top):
        print(f"  {name:40s} {seconds * ms:7.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
