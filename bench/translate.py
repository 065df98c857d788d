"""Decoding speed: attnlab beam search against HF `MarianMTModel.generate`, side by side in one run.

The same source sentences (Multi30k test2016 German, first --n lines) are tokenized once with a
joint BPE vocabulary learnt on Multi30k train (de + en), sorted by length and cut into the same
batches for both. Both models have identical sizes (a TransformerConfig preset: vocabulary,
d_model, layers, heads, d_ff; shared embeddings and tied output; ReLU; sinusoidal positions)
and random weights, fp32, the same thread count, beam 4, length penalty 0.6, and batches of
--batch-size sentences: by default 64, what `attnlab translate` uses unless told otherwise.
The ratio depends on it (HF's speed hardly moves with the batch size, attnlab's grows with it;
bench/RESULTS.md has the curve from 8 to 128), so a run states its batch size.

Random weights give arbitrary output lengths, so both searches are forced to the same length:
<eos> is suppressed (attnlab: its logit set to -1e4; HF: ``min_new_tokens``) until every
hypothesis has --out-len tokens, then ends. Each system then runs exactly --out-len + 1
decoder steps per batch; what differs is only how fast each step is. Timed: the search alone
(source ids in, token ids out), after one untimed warm-up run. Also timed: attnlab with the KV
cache off (the decoder re-reads the whole prefix each step), to show what the cache buys.

Each system first decodes one batch at a time on all --threads. Then, with --workers > 1 (the
default is --threads), attnlab as `attnlab translate` runs by default: that many batches at once,
the threads split between them (attnlab.decode.map_batches), and, to show what that scheme alone
gives, HF's generate run through the same map_batches (HF offers no such mode itself).

``--model DIR`` (a trained attnlab translation model) measures natural lengths instead: the
model's weights are copied into the HF Marian model (the same post-LN architecture; the
logits of both are checked equal before timing), nothing is forced, and each system decodes
as it does for users: attnlab drops a sentence from the batch when it ends, HF keeps a batch
running until its last sentence ends. Both outputs are scored with sacreBLEU against the
references, so equal quality is shown, not assumed. With --workers > 1 attnlab is also timed as
`attnlab translate` runs it (several batches at once), its outputs compared with its own
one-batch-at-a-time ones, and HF's generate is timed through the same scheme. With --repeats N
the systems are timed in N rounds, in turn, and each one's best pass is kept.

``--profile`` (forced-length mode) then runs each system once more under the torch profiler
and prints where its time goes, by kind of operation. The matrix products of the projections
and the output layer have the same shapes on both sides, so HF's time over its own time in
them bounds the ratio any implementation doing the same arithmetic can reach.

Usage: python bench/translate.py [--n 500] [--threads 4] [--preset transformer-base] [--profile]
       python bench/translate.py --model runs/m30k [--max-len 60]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SHARED_DATA, machine, read_gz_lines


def suppress_eos(model: torch.nn.Module, eos_id: int) -> None:
    """Make attnlab's model never choose <eos> (the search still forces it at max length)."""
    project = model.project

    def no_eos(hidden: torch.Tensor) -> torch.Tensor:
        logits = project(hidden)
        # Very unlikely, not impossible: -inf would also block the <eos> forced at max length.
        logits[..., eos_id] = -1e4
        return logits

    model.project = no_eos


def marian_like(config, vocab_size: int):
    """HF MarianMTModel with the attnlab config's sizes (random weights, eval mode)."""
    from transformers import MarianConfig, MarianMTModel

    hf_config = MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        d_model=config.d_model,
        encoder_layers=config.n_encoder_layers,
        decoder_layers=config.n_decoder_layers,
        encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function="relu",
        max_position_embeddings=config.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=config.pad_id,
        eos_token_id=config.eos_id,
        decoder_start_token_id=config.bos_id,
        forced_eos_token_id=None,
        dropout=0.0,
    )
    return MarianMTModel(hf_config).eval()


# Operator -> kind, for --profile (self CPU time; anything unlisted is "other").
OP_KINDS = {
    "aten::addmm": "projections (addmm/mm)",
    "aten::mm": "projections (addmm/mm)",
    "mkldnn::_linear_pointwise": "projections (addmm/mm)",  # oneDNN's product
    "aten::bmm": "attention products (bmm/sdpa)",
    "aten::baddbmm": "attention products (bmm/sdpa)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention products (bmm/sdpa)",
    "aten::_softmax": "softmax / log_softmax",
    "aten::_log_softmax": "softmax / log_softmax",
    "aten::topk": "top-k / sort",
    "aten::sort": "top-k / sort",
    "aten::index_select": "copies (cat/index/copy_/gather)",
    "aten::index": "copies (cat/index/copy_/gather)",
    "aten::cat": "copies (cat/index/copy_/gather)",
    "aten::copy_": "copies (cat/index/copy_/gather)",
    "aten::gather": "copies (cat/index/copy_/gather)",
}


def time_by_kind(fn) -> dict[str, float]:
    """Self CPU seconds of one call of fn, summed by OP_KINDS (plus "total")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        kind = OP_KINDS.get(event.key, "other")
        kinds[kind] = kinds.get(kind, 0.0) + event.self_cpu_time_total / 1e6
    kinds["total"] = sum(kinds.values())
    return kinds


def print_profile(profiles: dict[str, dict[str, float]]) -> dict[str, float]:
    """Print each system's time by kind as shares of its total; returns the matmul bound."""
    names = list(profiles)
    kinds = sorted({k for p in profiles.values() for k in p} - {"total"})
    print(f"{'kind of operation':38s}" + "".join(f"{n[:22]:>24s}" for n in names))
    for kind in [*kinds, "total"]:
        cells = ""
        for name in names:
            seconds = profiles[name].get(kind, 0.0)
            cells += f"{seconds:10.2f} s {100 * seconds / profiles[name]['total']:10.1f}%"
        print(f"{kind:38s}{cells}")
    hf = profiles["hf marian generate"]
    bound = hf["total"] / hf["projections (addmm/mm)"]
    print(f"HF total / HF projection time = {bound:.2f}x: the ratio at zero cost beyond them")
    return {"bound_at_zero_overhead": bound}


def length_sorted_batches(tokenizer, sources: list[str], config, batch_size: int) -> list[tuple]:
    """Sources as (rows, ids, mask) batches, longest first; rows are their places in sources."""
    from attnlab.text.parallel import encode_source, pad_batch

    ids = [
        encode_source(s, config.eos_id, config.max_positions)[0]
        for s in tokenizer.encode_batch(sources)
    ]
    order = sorted(range(len(sources)), key=lambda i: len(ids[i]), reverse=True)
    batches = []
    for i in range(0, len(order), batch_size):
        rows = order[i : i + batch_size]
        src = pad_batch([ids[r] for r in rows], config.pad_id)
        batches.append((rows, src, src != config.pad_id))
    return batches


def marian_with_weights(model: torch.nn.Module, vocab_size: int):
    """HF MarianMTModel holding the weights of an attnlab Transformer (post-LN, shared, tied)."""
    from attnlab.nn.positions import sinusoidal_table

    cfg = model.config
    if (cfg.norm_position, cfg.position_encoding, cfg.activation) != (
        "post",
        "sinusoidal",
        "relu",
    ) or not (cfg.share_embeddings and cfg.tie_output):
        raise SystemExit(
            "--model needs a post-LN, sinusoidal, ReLU model with shared, tied embeddings"
        )
    hf = marian_like(cfg, vocab_size)
    ours = model.state_dict()
    d = cfg.d_model
    mapped = {"model.shared.weight": ours["src_embed.weight"]}
    names = {"norm1": "self_attn_layer_norm", "ffn.fc1": "fc1", "ffn.fc2": "fc2"}
    for side, n_layers in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        last = {"encoder": "norm2", "decoder": "norm3"}[side]
        for i in range(n_layers):
            a, b = f"{side}.layers.{i}.", f"model.{side}.layers.{i}."
            for part in ("weight", "bias"):
                q, k, v = ours[f"{a}self_attn.qkv_proj.{part}"].split(d)
                mapped |= {f"{b}self_attn.q_proj.{part}": q, f"{b}self_attn.k_proj.{part}": k,
                           f"{b}self_attn.v_proj.{part}": v,
                           f"{b}self_attn.out_proj.{part}": ours[f"{a}self_attn.out_proj.{part}"],
                           f"{b}final_layer_norm.{part}": ours[f"{a}{last}.{part}"]}  # fmt: skip
                for ours_name, hf_name in names.items():
                    mapped[f"{b}{hf_name}.{part}"] = ours[f"{a}{ours_name}.{part}"]
                if side == "decoder":
                    k, v = ours[f"{a}cross_attn.kv_proj.{part}"].split(d)
                    mapped |= {f"{b}encoder_attn.q_proj.{part}": ours[f"{a}cross_attn.q_proj.{part}"],
                               f"{b}encoder_attn.k_proj.{part}": k, f"{b}encoder_attn.v_proj.{part}": v,
                               f"{b}encoder_attn.out_proj.{part}": ours[f"{a}cross_attn.out_proj.{part}"],
                               f"{b}encoder_attn_layer_norm.{part}": ours[f"{a}norm2.{part}"]}  # fmt: skip
    missing, unexpected = hf.load_state_dict(mapped, strict=False)
    tied_or_fixed = ("embed_tokens", "lm_head", "embed_positions", "final_logits_bias")
    left = [m for m in missing if not any(t in m for t in tied_or_fixed)]
    if left or unexpected:
        raise SystemExit(f"weights not mapped: {left or unexpected}")
    with torch.no_grad():  # Marian puts all sines before all cosines; attnlab interleaves them
        for side in (hf.model.encoder, hf.model.decoder):
            table = side.embed_positions.weight
            table.copy_(sinusoidal_table(table.shape[0], d))
    return hf.eval()


def check_same_logits(
    ours: torch.nn.Module, hf: torch.nn.Module, src: torch.Tensor, mask: torch.Tensor
) -> float:
    """Largest logit difference of the two models on a teacher-forced batch (fails above 1e-3)."""
    tgt = torch.cat(
        (torch.full((src.shape[0], 1), ours.config.bos_id), src[:, :-1].clamp(min=3)), 1
    )
    with torch.inference_mode():
        a = ours(src, tgt, src_mask=mask)["logits"]
        b = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).logits
    diff = float((a - b).abs().max())
    if diff > 1e-3:
        raise SystemExit(f"HF copy differs from the attnlab model: max logit difference {diff}")
    return diff


def speed_ratios(results: dict[str, dict], workers: int) -> dict[str, float]:
    """attnlab's speed over HF's: one batch at a time, and with workers if timed (printed)."""
    hf_speed = results["hf marian generate"]["sentences_per_s"]
    print(f"{'decoder':22s} {'sent/s':>9s} {'seconds':>8s} {'vs HF':>7s}")
    for name, r in results.items():
        s = r["sentences_per_s"]
        print(f"{name:22s} {s:9.2f} {r['seconds']:8.2f} {s / hf_speed:6.2f}x")
    ratios = {"ratio_vs_hf": results["attnlab beam_search"]["sentences_per_s"] / hf_speed}
    if workers > 1:
        ours_w = results[f"attnlab, {workers} workers"]["sentences_per_s"]
        hf_w = results[f"hf, {workers} workers"]["sentences_per_s"]
        ratios |= {
            "ratio_workers_vs_hf": ours_w / hf_speed,
            "ratio_workers_vs_hf_workers": ours_w / hf_w,
        }
        print(f"attnlab as `attnlab translate` runs it ({workers} workers) / HF generate: "
              f"{ours_w / hf_speed:.2f}x; / HF in the same {workers} workers: {ours_w / hf_w:.2f}x")  # fmt: skip
    return ratios


def natural(args: argparse.Namespace) -> None:
    """Trained weights in both systems, natural lengths; sentences/s, ratio and BLEU of each."""
    import sacrebleu

    from attnlab import fast
    from attnlab.decode import beam_search, map_batches, translate_batches
    from attnlab.tasks.translate import load_translation_model

    model, tokenizer = load_translation_model(args.model)
    model.eval()
    cfg = model.config
    hf = marian_with_weights(model, cfg.tgt_vocab_size)
    data = SHARED_DATA / "multi30k"
    sources = read_gz_lines(data / "test_2016_flickr.de.gz")[: args.n]
    refs = read_gz_lines(data / "test_2016_flickr.en.gz")[: args.n]
    batches = length_sorted_batches(tokenizer, sources, cfg, args.batch_size)
    diff = check_same_logits(model, hf, batches[0][1], batches[0][2])
    print(
        f"machine: {machine()}; max logit difference attnlab vs HF copy: {diff:.2e}",
        file=sys.stderr,
    )

    def run_ours() -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sources]
        with fast.inference_twins(model):  # the fast twins, as `attnlab translate` runs
            for rows, src, mask in batches:
                hyps = beam_search(model, src, mask, beam_size=args.beam, length_penalty=0.6,
                                   max_len_a=0.0, max_len_b=args.max_len)  # fmt: skip
                for r, h in zip(rows, hyps, strict=True):
                    out[r] = h
        return out

    def hf_batch(batch: tuple) -> list[list[int]]:
        _, src, mask = batch
        with torch.inference_mode():  # per thread: workers need it too
            gen = hf.generate(input_ids=src, attention_mask=mask.long(), num_beams=args.beam,
                              length_penalty=0.6, max_new_tokens=args.max_len + 1,
                              do_sample=False)  # fmt: skip
        hyps = []
        for row in gen.tolist():
            row = row[1:]  # decoder start token
            end = row.index(cfg.eos_id) if cfg.eos_id in row else len(row)
            hyps.append([t for t in row[:end] if t != cfg.pad_id])
        return hyps

    def run_hf(workers: int = 1) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sources]
        for (rows, _, _), hyps in zip(
            batches, map_batches(hf_batch, batches, workers), strict=True
        ):
            for r, h in zip(rows, hyps, strict=True):
                out[r] = h
        return out

    def run_ours_workers() -> list[list[int]]:
        # As `attnlab translate` runs by default: several batches at once, the threads split.
        with fast.inference_twins(model):
            hyps = translate_batches(model, [(src, mask) for _, src, mask in batches], args.workers,
                                     beam_size=args.beam, length_penalty=0.6, max_len_a=0.0,
                                     max_len_b=args.max_len)  # fmt: skip
        out: list[list[int]] = [[] for _ in sources]
        for (rows, _, _), batch_hyps in zip(batches, hyps, strict=True):
            for r, h in zip(rows, batch_hyps, strict=True):
                out[r] = h
        return out

    systems = [("hf marian generate", run_hf), ("attnlab beam_search", run_ours)]
    if args.workers > 1:
        systems.append((f"attnlab, {args.workers} workers", run_ours_workers))
        systems.append((f"hf, {args.workers} workers", lambda: run_hf(args.workers)))
    for _, fn in systems:
        fn()  # warm-up
    # --repeats rounds, each system once per round, in turn; the best of each. The machine's
    # speed drifts within minutes: rounds keep the systems' passes close in time.
    results = {}
    for _ in range(args.repeats):
        for name, fn in systems:
            t0 = time.perf_counter()
            hyps = fn()
            seconds = time.perf_counter() - t0
            if name in results and results[name]["seconds"] <= seconds:
                continue
            bleu = sacrebleu.corpus_bleu(tokenizer.decode_batch(hyps), [refs]).score
            mean_len = sum(map(len, hyps)) / len(hyps)
            results[name] = {"sentences_per_s": len(sources) / seconds, "seconds": seconds,
                             "bleu": bleu, "mean_output_tokens": mean_len, "hyps": hyps}  # fmt: skip
    same = sum(
        a == b
        for a, b in zip(
            results["hf marian generate"]["hyps"],
            results["attnlab beam_search"]["hyps"],
            strict=True,
        )
    )
    workers_same = (
        sum(a == b for a, b in zip(results["attnlab beam_search"]["hyps"],
                                   results[f"attnlab, {args.workers} workers"]["hyps"], strict=True))
        if args.workers > 1
        else None
    )  # fmt: skip
    hf_speed = results["hf marian generate"]["sentences_per_s"]
    print(f"{'decoder':22s} {'sent/s':>9s} {'seconds':>8s} {'BLEU':>6s} {'vs HF':>7s}")
    for name, r in results.items():
        print(f"{name:22s} {r['sentences_per_s']:9.2f} {r['seconds']:8.2f} {r['bleu']:6.2f} "
              f"{r['sentences_per_s'] / hf_speed:6.2f}x")  # fmt: skip
    ratios = speed_ratios(results, args.workers)
    for r in results.values():
        del r["hyps"]
    print(json.dumps({"bench": "translate-natural", "model": str(args.model), "sentences": len(sources),
                      "threads": args.threads, "batch_size": args.batch_size, "beam": args.beam,
                      "max_len": args.max_len, "identical_outputs": same, "max_logit_diff": diff,
                      "workers": args.workers, "workers_identical_to_one_batch": workers_same,
                      "repeats": args.repeats, **ratios, "results": results}))  # fmt: skip


def main() -> None:
    """Decode the same batches with both systems and print sentences/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="source sentences")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--preset", default="transformer-base")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument(
        "--batch-size", type=int, default=64, help="sentences per batch (`attnlab translate`'s 64)"
    )
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--out-len", type=int, default=30, help="tokens every hypothesis gets")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes, best kept")
    parser.add_argument("--workers", type=int, help="batches at once (default: --threads)")
    parser.add_argument("--no-uncached", action="store_true", help="skip the KV-cache-off run")
    parser.add_argument("--model", help="trained attnlab translation model: natural lengths")
    parser.add_argument("--max-len", type=int, default=60, help="--model: max output tokens")
    parser.add_argument("--profile", action="store_true", help="time by kind of operation")
    parser.add_argument(
        "--only", choices=("attnlab",), help="time attnlab's one-batch decoder alone (speedup_ab)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.workers = args.workers or args.threads
    if args.model:
        natural(args)
        return

    from attnlab import fast
    from attnlab.config import TransformerConfig
    from attnlab.decode import beam_search, map_batches, translate_batches
    from attnlab.models.seq2seq import Transformer
    from attnlab.text.bpe import train_bpe

    data = SHARED_DATA / "multi30k"
    start = time.perf_counter()
    tokenizer = train_bpe([data / "train.de.gz", data / "train.en.gz"], args.vocab_size)
    sources = read_gz_lines(data / "test_2016_flickr.de.gz")[: args.n]
    config = TransformerConfig.preset(
        args.preset,
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.sos_id,
        eos_id=tokenizer.eos_id,
        dropout=0.0,
    )
    torch.manual_seed(0)
    ours = Transformer(config).eval()
    suppress_eos(ours, config.eos_id)
    hf = marian_like(config, tokenizer.vocab_size)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())

    batches = length_sorted_batches(tokenizer, sources, config, args.batch_size)
    n_tokens = sum(int(mask.sum()) for _, _, mask in batches)
    print(f"machine: {machine()}", file=sys.stderr)
    print(
        f"{len(sources)} sentences (mean {n_tokens / len(sources):.1f} source tokens), "
        f"{len(batches)} batches of <= {args.batch_size}, beam {args.beam}, "
        f"{args.out_len} output tokens each; {args.preset}: vocab {tokenizer.vocab_size}, "
        f"params attnlab {n_ours / 1e6:.1f}M / HF {n_hf / 1e6:.1f}M; "
        f"setup {time.perf_counter() - start:.0f}s",
        file=sys.stderr,
    )

    def run_ours(use_cache: bool) -> list[int]:
        lengths = []
        with fast.inference_twins(ours):  # the fast twins, as `attnlab translate` runs
            for _, src, mask in batches:
                hyps = beam_search(ours, src, mask, beam_size=args.beam, length_penalty=0.6,
                                   max_len_a=0.0, max_len_b=args.out_len, use_cache=use_cache)  # fmt: skip
                lengths += [len(h) for h in hyps]
        return lengths

    def run_ours_workers() -> list[int]:
        # What `attnlab translate` does by default: several batches at once, one thread each.
        with fast.inference_twins(ours):
            hyps = translate_batches(ours, [(src, mask) for _, src, mask in batches], args.workers,
                                     beam_size=args.beam, length_penalty=0.6, max_len_a=0.0,
                                     max_len_b=args.out_len)  # fmt: skip
        return [len(h) for batch in hyps for h in batch]

    def hf_batch(batch: tuple) -> list[int]:
        _, src, mask = batch
        with torch.inference_mode():  # per thread: workers need it too
            out = hf.generate(
                input_ids=src,
                attention_mask=mask.long(),
                num_beams=args.beam,
                length_penalty=0.6,
                max_new_tokens=args.out_len + 1,
                min_new_tokens=args.out_len + 1,
                do_sample=False,
            )
        # out: decoder start token + out_len + 1 tokens (the last one not <eos>)
        return [int((row != config.pad_id).sum()) - 2 for row in out]

    def run_hf(workers: int = 1) -> list[int]:
        return [n for lengths in map_batches(hf_batch, batches, workers) for n in lengths]

    runs = {"hf marian generate": run_hf, "attnlab beam_search": lambda: run_ours(True)}
    if args.workers > 1:
        runs[f"attnlab, {args.workers} workers"] = run_ours_workers
        runs[f"hf, {args.workers} workers"] = lambda: run_hf(args.workers)
    if not args.no_uncached:
        runs["attnlab, no KV cache"] = lambda: run_ours(False)
    if args.only:
        runs = {"attnlab beam_search": runs["attnlab beam_search"]}
    results: dict[str, dict[str, float]] = {}
    for name, fn in runs.items():
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            lengths = fn()
            best = min(best, time.perf_counter() - t0)
        if set(lengths) != {args.out_len}:
            raise SystemExit(f"{name}: output lengths {sorted(set(lengths))}, not {args.out_len}")
        results[name] = {"sentences_per_s": len(sources) / best, "seconds": best}

    ratios = {} if args.only else speed_ratios(results, args.workers)
    summary = {
        "bench": "translate",
        "preset": args.preset,
        "sentences": len(sources),
        "threads": args.threads,
        "batch_size": args.batch_size,
        "beam": args.beam,
        "out_len": args.out_len,
        "vocab_size": tokenizer.vocab_size,
        "workers": args.workers,
        **ratios,
        "results": results,
    }
    if args.profile:
        profiles = {name: time_by_kind(runs[name]) for name in list(runs)[:2]}
        summary["profile"] = {**profiles, **print_profile(profiles)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
