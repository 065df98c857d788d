"""`attnlab serve` against real uvicorn processes on loopback: each endpoint equals the CLI.

One tiny model folder per kind (a random BERT with its MLM head, a random fine-tuned
classifier, a random translation model), one server process per folder; requests go over
http.client, as any client would send them.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab import cli
from attnlab.config import BertConfig, GPTConfig, TransformerConfig
from attnlab.interop.gpt2 import save_gpt
from attnlab.interop.hf import build_task_model, save_bert, save_task_model
from attnlab.models.bert import BertForPreTraining
from attnlab.models.gpt import GPT
from attnlab.models.seq2seq import Transformer
from attnlab.tasks.translate import save_model_dir
from attnlab.text.bpe import train_bpe_from_texts
from attnlab.text.lm_tokenizer import char_tokenizer
from attnlab.text.tokenizer import BertTokenizer

MAX_POSITIONS = 32
API_KEY = "test-key-123"
SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "今天天气很好。",
    "x",
    "Numbers: 3.14159 and -42.",
]
PARALLEL = [
    "Ein Mann fährt mit dem Fahrrad durch die Stadt.",
    "A man rides his bike through the city.",
    "Zwei Kinder spielen im Garten.",
    "Two children are playing in the garden.",
]


# ------------------------------------------------------------------------------ folders


def _bert_config(tokenizer: BertTokenizer, max_positions: int = MAX_POSITIONS) -> BertConfig:
    return BertConfig.preset(
        "bert-tiny", vocab_size=tokenizer.vocab_size, max_positions=max_positions
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_dir: Path) -> dict[str, Path]:
    """A tiny random BERT (MLM head), fine-tuned classifier, and translation model."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = BertTokenizer.from_vocab(minilm_dir / "vocab.txt")
    torch.manual_seed(0)
    save_bert(BertForPreTraining(_bert_config(tokenizer)).eval(), root / "bert", tokenizer)
    classifier = build_task_model(_bert_config(tokenizer, 128), "classify", 2)  # predict reads 128
    save_task_model(classifier.eval(), root / "classify", tokenizer, ["neg", "pos"])
    tagger = build_task_model(_bert_config(tokenizer, 128), "ner", 3)
    save_task_model(tagger.eval(), root / "ner", tokenizer, ["O", "B-PER", "I-PER"])
    reader = build_task_model(_bert_config(tokenizer, 384), "qa")  # qa reads 384 tokens
    save_task_model(reader.eval(), root / "qa", tokenizer)
    bpe = train_bpe_from_texts(PARALLEL * 4, vocab_size=120, min_frequency=1)
    config = TransformerConfig(
        src_vocab_size=bpe.vocab_size, tgt_vocab_size=bpe.vocab_size, d_model=32, n_heads=4,
        d_ff=64, n_encoder_layers=1, n_decoder_layers=1, max_positions=MAX_POSITIONS,
    )  # fmt: skip
    save_model_dir(root / "translation", config, bpe, Transformer(config).eval())
    chars = char_tokenizer("abcdefghijklmnopqrstuvwxyz .,")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=chars.vocab_size, d_model=32, n_layers=1, n_heads=4, d_ff=64,
                        max_positions=64, dropout=0.0, attention_dropout=0.0))  # fmt: skip
    save_gpt(gpt.eval(), root / "gpt", chars)
    names = ("bert", "classify", "ner", "qa", "translation", "gpt")
    return {name: root / name for name in names}


# ------------------------------------------------------------------------------ servers


class Served:
    """A running `attnlab serve` process and its port; its log collected from stderr."""

    def __init__(self, folder: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "attnlab", "serve", "--model", str(folder),
                   "--port", "0", "--threads", "1", *flags]  # fmt: skip
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        self.log: list[str] = []
        self._port: int | None = None

    @property
    def port(self) -> int:
        """The port the server bound (waits for its start: servers start side by side)."""
        if self._port is None:
            self._port = self._wait_for_port()
            threading.Thread(target=self._drain, daemon=True).start()
        return self._port

    def _wait_for_port(self) -> int:
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if found:
                return int(found.group(1))
        raise AssertionError("the server did not start:\n" + "".join(self.log))

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    def request(
        self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        """(status, headers, body) of one request on a new connection."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request(method, path, body=data, headers=all_headers)
        response = connection.getresponse()
        result = response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        connection.close()
        return result

    def post(self, path: str, body: object, **kwargs: object) -> tuple[int, dict]:
        """(status, JSON answer) of a POST."""
        status, _, data = self.request("POST", path, body, **kwargs)  # type: ignore[arg-type]
        return status, json.loads(data)

    def stop(self) -> int:
        """SIGTERM, then the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def servers(folders) -> Iterator[dict[str, Served]]:
    """One server per folder, started together (each start is mostly importing torch)."""
    started = {
        "bert": Served(folders["bert"]),
        "classify": Served(folders["classify"], env={"ATTNLAB_API_KEY": API_KEY}),
        "ner": Served(folders["ner"]),
        "qa": Served(folders["qa"]),
        "gpt": Served(folders["gpt"]),
        # A queue of one request held 300 ms: a second request at once finds it full.
        "translation": Served(
            folders["translation"],
            "--max-queue",
            "1",
            "--max-wait-ms",
            "300",
            "--max-batch-tokens",
            "100000",
        ),
    }
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def bert(servers) -> Served:
    return servers["bert"]


@pytest.fixture(scope="module")
def classifier(servers) -> Served:
    return servers["classify"]


@pytest.fixture(scope="module")
def tagger(servers) -> Served:
    return servers["ner"]


@pytest.fixture(scope="module")
def reader(servers) -> Served:
    return servers["qa"]


@pytest.fixture(scope="module")
def writer(servers) -> Served:
    return servers["gpt"]


@pytest.fixture(scope="module")
def translator(servers) -> Served:
    return servers["translation"]


def run_cli(capsys, *argv: str) -> str:
    """The stdout of an attnlab command run in this process."""
    capsys.readouterr()
    assert cli.main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ------------------------------------------------------------------------------ endpoints = CLI


def test_embeddings_equal_attnlab_embed(bert, folders, tmp_path, capsys):
    """OpenAI's shape; mean pooling + L2 by default, as `attnlab embed --normalize`."""
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = run_cli(capsys, "embed", "--model", str(folders["bert"]), "--normalize",
                  "--input", str(tmp_path / "in.txt"))  # fmt: skip
    expected = torch.tensor([json.loads(line) for line in out.splitlines()])
    status, answer = bert.post("/v1/embeddings", {"input": SENTENCES, "model": "x"})
    assert status == 200
    assert answer["object"] == "list" and answer["model"] == "bert"
    assert [d["index"] for d in answer["data"]] == list(range(len(SENTENCES)))
    assert {d["object"] for d in answer["data"]} == {"embedding"}
    got = torch.tensor([d["embedding"] for d in answer["data"]])
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    usage = answer["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(SENTENCES) * 2
    status, one = bert.post("/v1/embeddings", {"input": SENTENCES[1], "normalize": False})
    raw = run_cli(capsys, "embed", "--model", str(folders["bert"]), "--input",
                  str(tmp_path / "in.txt"))  # fmt: skip
    torch.testing.assert_close(torch.tensor(one["data"][0]["embedding"]),
                               torch.tensor(json.loads(raw.splitlines()[1])), atol=2e-6, rtol=0)  # fmt: skip
    # OpenAI's clients ask for base64 by default: the same float32 values, little-endian
    status, packed = bert.post("/v1/embeddings", {"input": SENTENCES, "encoding_format": "base64"})
    assert status == 200
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]]
    assert torch.equal(torch.from_numpy(np.stack(decoded)), got.float())


def test_fill_mask_equals_cli(bert, folders, capsys):
    texts = ["hello [MASK] world", "the [MASK] is [MASK] today"]
    lines = run_cli(capsys, "fill-mask", "--model", str(folders["bert"]), "--json",
                    "--top-k", "3", *texts).splitlines()  # fmt: skip
    status, answer = bert.post("/v1/fill-mask", {"input": texts, "top_k": 3})
    assert status == 200
    for line, got in zip(lines, answer["data"], strict=True):
        expected = json.loads(line)
        assert got["text"] == expected["text"]
        for mask, want in zip(got["masks"], expected["masks"], strict=True):
            assert [m["token"] for m in mask] == [t for t, _ in want]
            assert [m["probability"] for m in mask] == pytest.approx([p for _, p in want], rel=1e-4)
    status, answer = bert.post("/v1/fill-mask", {"input": "no mask here"})
    assert status == 422 and "[MASK]" in answer["error"]["message"]


def test_classify_equals_attnlab_predict(classifier, folders, tmp_path, capsys):
    rows = [{"text": text, "label": "neg"} for text in SENTENCES]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run_cli(capsys, "predict", "--model", str(folders["classify"]), "--input", str(source),
            "--output", str(tmp_path / "out.jsonl"))  # fmt: skip
    expected = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    status, answer = classifier.post("/v1/classify", {"input": SENTENCES}, headers=AUTH)
    assert status == 200
    for i, (got, want) in enumerate(zip(answer["data"], expected, strict=True)):
        assert got["index"] == i and got["text"] == want["text"]
        assert got["label"] == want["label"]
        for name, p in want["probabilities"].items():
            assert got["probabilities"][name] == pytest.approx(p, abs=2e-6)


def test_ner_equals_attnlab_predict(tagger, folders, tmp_path, capsys):
    sentences = [["John", "lives", "in", "Berlin", "."], ["Hello", "there"]]
    conll = "".join("".join(f"{w} O\n" for w in words) + "\n" for words in sentences)
    (tmp_path / "in.conll").write_text(conll, encoding="utf-8")
    run_cli(capsys, "predict", "--model", str(folders["ner"]), "--input",
            str(tmp_path / "in.conll"), "--output", str(tmp_path / "out.jsonl"))  # fmt: skip
    expected = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    status, answer = tagger.post("/v1/ner", {"input": sentences})
    assert status == 200
    assert [{"words": d["words"], "tags": d["tags"]} for d in answer["data"]] == expected
    status, answer = tagger.post("/v1/ner", {"input": "John lives in Berlin ."})  # split at spaces
    assert answer["data"][0]["tags"] == expected[0]["tags"]
    assert tagger.post("/v1/classify", {"input": "a"})[0] == 404  # a tagger answers /v1/ner only


def test_qa_equals_attnlab_predict(reader, folders, tmp_path, capsys):
    questions = [("Who lives in Berlin?", "John lives in Berlin with his two cats."),
                 ("What is red?", "The apple is red and the sky is blue.")]  # fmt: skip
    squad = {"data": [{"paragraphs": [
        {"context": c, "qas": [{"id": f"q{i}", "question": q, "answers": []}]}
        for i, (q, c) in enumerate(questions)]}]}  # fmt: skip
    (tmp_path / "in.json").write_text(json.dumps(squad), encoding="utf-8")
    run_cli(capsys, "predict", "--model", str(folders["qa"]), "--input",
            str(tmp_path / "in.json"), "--output", str(tmp_path / "out.json"))  # fmt: skip
    expected = json.loads((tmp_path / "out.json").read_text())
    body = {"input": [{"question": q, "context": c} for q, c in questions]}
    status, answer = reader.post("/v1/qa", body)
    assert status == 200
    assert [d["answer"] for d in answer["data"]] == [expected["q0"], expected["q1"]]
    status, answer = reader.post("/v1/qa", {"input": {"question": "Who?"}})
    assert status == 422 and "context" in answer["error"]["message"]


def test_completions_equal_generate_texts(writer, folders):
    """OpenAI's completions shape; greedy (temperature 0) and seeded sampling as the library's
    generate_texts (what `attnlab generate` runs); stream: true as server-sent events."""
    from attnlab.tasks.lm import generate_texts, load_lm

    model, tokenizer = load_lm(folders["gpt"])
    prompts = ["the cat", "a dog, a"]
    greedy = generate_texts(model, tokenizer, prompts, max_new_tokens=12, greedy=True)
    status, answer = writer.post("/v1/completions", {"prompt": prompts, "max_tokens": 12,
                                                     "temperature": 0})  # fmt: skip
    assert status == 200 and answer["object"] == "text_completion"
    assert [c["text"] for c in answer["choices"]] == [text for _, text in greedy]
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert {c["finish_reason"] for c in answer["choices"]} == {"length"}  # no end token
    assert answer["usage"] == {"prompt_tokens": 15, "completion_tokens": 24, "total_tokens": 39}
    sampled = generate_texts(model, tokenizer, prompts, max_new_tokens=8, temperature=0.9,
                             top_k=5, seed=7, num_samples=2)  # fmt: skip
    status, answer = writer.post("/v1/completions", {"prompt": prompts, "max_tokens": 8,
                                 "temperature": 0.9, "top_k": 5, "seed": 7, "n": 2})  # fmt: skip
    assert [c["text"] for c in answer["choices"]] == [text for _, text in sampled]
    status, headers, data = writer.request("POST", "/v1/completions", {
        "prompt": "the cat", "max_tokens": 12, "temperature": 0, "stream": True})  # fmt: skip
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in data.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert "".join(c["text"] for c in chunks) == greedy[0][1]
    assert chunks[-1]["finish_reason"] == "length" and len(chunks) > 2
    for body, status in (({"prompt": "x", "max_tokens": 64}, 422),  # no room for the prompt
                         ({"prompt": "x", "max_tokens": 2000}, 413),
                         ({"prompt": "x", "n": 17}, 413), ({"prompt": "x", "top_p": 0}, 422),
                         ({"prompt": ["x", "y"], "stream": True}, 422)):  # fmt: skip
        assert writer.post("/v1/completions", body)[0] == status, body


def test_translate_equals_attnlab_translate(translator, folders, tmp_path, capsys):
    lines = [PARALLEL[0], PARALLEL[2], "", "Zwei Kinder."]
    (tmp_path / "src.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for flags, body in (((), {}), (("--beam", "2", "--length-penalty", "1.0"),
                                    {"beam": 2, "length_penalty": 1.0}),
                        (("--greedy",), {"greedy": True})):  # fmt: skip
        out = run_cli(capsys, "translate", "--model", str(folders["translation"]),
                      "--input", str(tmp_path / "src.txt"), *flags)  # fmt: skip
        status, answer = translator.post("/v1/translate", {"input": lines, **body})
        assert status == 200, answer
        assert [d["translation"] for d in answer["data"]] == out.splitlines()
    status, answer = translator.post("/v1/translate", {"input": "x", "beam": 0})
    assert status == 422 and "beam" in answer["error"]["message"]
    status, answer = translator.post("/v1/translate", {"input": "x", "beam": 17})
    assert status == 413 and answer["error"]["limit"] == "max_beam"


def test_health_metrics_docs(bert):
    status, health = bert.post("/v1/embeddings", {"input": "warm"})
    status, _, data = bert.request("GET", "/health")
    health = json.loads(data)
    assert status == 200 and health["status"] == "ok" and health["kind"] == "bert"
    assert health["endpoints"] == ["/v1/embeddings", "/v1/fill-mask", "/v1/attention"]
    status, headers, data = bert.request("GET", "/metrics")
    text = data.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'attnlab_requests_total{endpoint="/v1/embeddings",status="200"}' in text
    for name in ("attnlab_request_errors_total", "attnlab_queue_length",
                 "attnlab_batch_size_bucket", "attnlab_batch_tokens_count",
                 "attnlab_request_latency_seconds_bucket"):  # fmt: skip
        assert name in text
    status, _, data = bert.request("GET", "/docs")
    assert status == 200 and b"swagger" in data.lower()
    status, _, data = bert.request("GET", "/openapi.json")
    assert "/v1/embeddings" in json.loads(data)["paths"]


def test_attention_equals_attnlab_attention(bert, translator, folders, tmp_path, capsys):
    """/v1/attention is `attnlab attention --output FILE.json`; GET /?text= is its page."""
    for server, folder, body, flags in (
        (bert, folders["bert"], {"text": "the cat sat", "pair": "on a mat"}, ["--pair", "on a mat"]),
        (bert, folders["bert"], {"text": "the cat sat", "layers": [1], "heads": [0, 1]},
         ["--layers", "1", "--heads", "0,1"]),
        (translator, folders["translation"], {"text": PARALLEL[2]}, []),
    ):  # fmt: skip
        out = tmp_path / "maps.json"
        run_cli(capsys, "attention", "--model", str(folder), body["text"], *flags,
                "--out", str(out), "--overwrite")  # fmt: skip
        expected = json.loads(out.read_text(encoding="utf-8"))
        status, answer = server.post("/v1/attention", body)
        assert status == 200, answer
        assert answer.pop("model") == folder.name
        assert answer.keys() == expected.keys()
        assert answer["tokens"] == expected["tokens"]
        for kind, weights in expected["attention"].items():
            torch.testing.assert_close(torch.tensor(answer["attention"][kind]),
                                       torch.tensor(weights), atol=1e-6, rtol=0)  # fmt: skip
    status, headers, data = bert.request("GET", "/?text=the%20cat%20sat")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"<script" in data and ["the", "cat", "sat"][1].encode() in data
    assert bert.request("GET", "/")[0] == 200  # a form
    status, answer = translator.post("/v1/attention", {"text": "x", "pair": "y"})
    assert status == 422 and "pair" in answer["error"]["message"]


# ------------------------------------------------------------------------------ safety


def test_api_key(classifier):
    body = {"input": "a"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, headers_out, data = classifier.request("POST", "/v1/classify", body, headers)
        assert status == 401 and headers_out["www-authenticate"] == "Bearer"
        assert json.loads(data)["error"]["type"] == "authentication_error"
    assert classifier.request("GET", "/metrics")[0] == 401
    assert classifier.request("GET", "/docs")[0] == 401
    assert classifier.request("GET", "/health")[0] == 200  # probes need no key
    assert classifier.post("/v1/classify", body, headers=AUTH)[0] == 200


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 422, "malformed JSON"),
        (b"[1, 2]", 422, "body"),
        (json.dumps({"input": 5}).encode(), 422, "input"),
        (json.dumps({"input": ["a", 5]}).encode(), 422, "input"),
        (json.dumps({"input": "a", "normalize": "yes"}).encode(), 422, "normalize"),
        (json.dumps({"input": "a", "unknown": 1}).encode(), 422, "unknown"),
        (json.dumps({"input": "a", "encoding_format": "int8"}).encode(), 422, "encoding_format"),
        (json.dumps({"input": []}).encode(), 422, "empty"),
        (b'{"input": "\\ud800"}', 422, "surrogate"),
        (json.dumps({"input": ["a"] * 257}).encode(), 413, "max_items"),
        (json.dumps({"input": "a" * 20_001}).encode(), 413, "max_text_chars"),
        (json.dumps({"input": ["word"] * 300_000}).encode(), 413, "max_body_bytes"),
        (json.dumps({"input": "word " * 40, "truncate": False}).encode(), 422, "max_length"),
    ],
)
def test_bad_input(bert, body, status, words):
    """Each bad request: its status and a JSON error that names the field or limit."""
    got, _, data = bert.request("POST", "/v1/embeddings", raw=body)
    error = json.loads(data)["error"]
    assert got == status, error
    assert words in error["message"] or words == error.get("limit"), error
    assert "Traceback" not in error["message"]


def test_overlong_text_truncated_by_default(bert, folders, tmp_path, capsys):
    text = "word " * 40  # past the 32 positions
    (tmp_path / "in.txt").write_text(text + "\n", encoding="utf-8")
    expected = json.loads(run_cli(capsys, "embed", "--model", str(folders["bert"]),
                                  "--normalize", "--input", str(tmp_path / "in.txt")))  # fmt: skip
    status, answer = bert.post("/v1/embeddings", {"input": text})
    assert status == 200 and answer["usage"]["prompt_tokens"] == MAX_POSITIONS
    torch.testing.assert_close(torch.tensor(answer["data"][0]["embedding"]),
                               torch.tensor(expected), atol=2e-6, rtol=0)  # fmt: skip


def test_unknown_path_and_method(bert):
    status, _, data = bert.request("GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(data)
    status, _, data = bert.request("GET", "/v1/embeddings")
    assert status == 405 and "error" in json.loads(data)
    status, _, data = bert.request("POST", "/v1/translate", {"input": "a"})
    assert status == 404  # a BERT folder has no translation endpoint


# ------------------------------------------------------------------------------ batching


def test_full_queue_503_and_disconnect_frees_the_slot(translator):
    """max_queue 1, a job held 300 ms: a second request finds the queue full; a client that
    goes away while queued frees its slot at once."""
    results: list[int] = []
    first = threading.Thread(
        target=lambda: results.append(translator.post("/v1/translate", {"input": "a"})[0])
    )
    first.start()
    time.sleep(0.1)
    status, headers, data = translator.request("POST", "/v1/translate", {"input": "b"})
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(data)["error"]["limit"] == "max_queue"
    first.join()
    assert results == [200]
    # A client that sends its request and hangs up while it waits in the queue.
    body = json.dumps({"input": "c"}).encode()
    with socket.create_connection(("127.0.0.1", translator.port)) as sock:
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        time.sleep(0.1)
    time.sleep(0.1)
    assert translator.post("/v1/translate", {"input": "d"})[0] == 200  # the slot is free
    metrics = translator.request("GET", "/metrics")[2].decode()
    assert re.search(r"^attnlab_client_disconnects_total 1\.0$", metrics, re.MULTILINE)


def test_a_free_worker_starts_at_once_and_requests_gather_while_it_runs():
    """Default settings: the first request runs alone; those queued while its batch
    runs are answered together by the next batch, each with its own results."""
    import asyncio

    from attnlab.serve.batching import Batcher, BatchSettings

    started, release, batches = threading.Event(), threading.Event(), []

    def run(key, items):
        batches.append(list(items))
        if len(batches) == 1:
            started.set()
            release.wait(30)
        return [item.upper() for item in items]

    settings = BatchSettings()
    batcher = Batcher(run, settings.max_batch_tokens, settings.max_wait_ms, settings.max_queue)

    async def clients() -> list[list[str]]:
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("k", ["a"], [1]))
        assert await asyncio.to_thread(started.wait, 30)  # alone: nothing else was queued
        later = [asyncio.ensure_future(batcher.submit("k", [t], [1])) for t in ("b", "c")]
        while batcher.queue_length() < 2:
            await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(first, *later)

    try:
        assert asyncio.run(clients()) == [["A"], ["B"], ["C"]]
    finally:
        release.set()
        batcher.stop()
    assert batches == [["a"], ["b", "c"]]


def test_load_16_concurrent_clients(bert, folders):
    """16 clients for about 3 s: no errors, every answer equal to the offline embedding."""
    from attnlab.interop.hf import load_bert
    from attnlab.tasks.embed import embed

    model = load_bert(folders["bert"])
    tokenizer = BertTokenizer.from_dir(folders["bert"])
    texts = [f"{s} {i}" for i, s in enumerate(SENTENCES * 4)]
    expected = dict(zip(texts, embed(model, tokenizer, texts, normalize=True), strict=True))
    failures: list[str] = []
    answered = [0]
    stop_at = time.monotonic() + 3

    def client(seed: int) -> None:
        n = seed
        while time.monotonic() < stop_at:
            batch = [texts[(n + k) % len(texts)] for k in range(1 + n % 3)]
            n += 5
            status, answer = bert.post("/v1/embeddings", {"input": batch})
            if status != 200:
                failures.append(f"{status} {answer}")
                continue
            for text, item in zip(batch, answer["data"], strict=True):
                got = torch.tensor(item["embedding"])
                if not torch.allclose(got, expected[text], atol=1e-5):
                    failures.append(f"wrong vector for {text!r}")
            answered[0] += len(batch)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert answered[0] > 16
    metrics = bert.request("GET", "/metrics")[2].decode()
    count = re.search(r"^attnlab_batch_size_count (\S+)$", metrics, re.MULTILINE)
    total = re.search(r"^attnlab_batch_size_sum (\S+)$", metrics, re.MULTILINE)
    assert float(total.group(1)) / float(count.group(1)) > 1  # requests were batched
    print(f"load: {answered[0] / 3:.0f} sentences/s answered")


def test_sigterm_drains_in_flight_requests(folders):
    """SIGTERM while a request waits for its batch: it is answered, then the exit code is 0."""
    server = Served(folders["bert"], "--max-wait-ms", "1000", "--max-batch-tokens", "100000")
    assert server.port  # started
    results: list[int] = []
    thread = threading.Thread(
        target=lambda: results.append(server.post("/v1/embeddings", {"input": SENTENCES})[0])
    )
    thread.start()
    time.sleep(0.3)
    server.process.send_signal(signal.SIGTERM)
    thread.join(timeout=30)
    assert results == [200]
    assert server.process.wait(timeout=30) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_limit_flags_are_enforced(folders):
    """Lowered --max-* flags: each request past one is refused with 413 naming its limit,
    and requests within them are answered."""
    server = Served(folders["bert"], "--max-items", "2", "--max-text-chars", "12",
                    "--max-body-bytes", "300", "--max-top-k", "2")  # fmt: skip
    try:
        refused = [
            ("/v1/embeddings", {"input": ["a", "b", "c"]}, "max_items"),
            ("/v1/embeddings", {"input": "x" * 13}, "max_text_chars"),
            ("/v1/embeddings", {"input": ["x"], "model": "m" * 300}, "max_body_bytes"),
            ("/v1/fill-mask", {"input": "a [MASK]", "top_k": 3}, "max_top_k"),
        ]
        for path, body, limit in refused:
            status, answer = server.post(path, body)
            assert status == 413 and answer["error"]["limit"] == limit, answer
            assert limit in answer["error"]["message"]
        status, answer = server.post("/v1/embeddings", {"input": ["a", "x" * 12]})
        assert status == 200 and len(answer["data"]) == 2
        assert server.post("/v1/fill-mask", {"input": "a [MASK]", "top_k": 2})[0] == 200
    finally:
        assert server.stop() == 0


def test_cli_refuses_bad_settings(folders, capsys):
    assert cli.main(["serve", "--model", str(folders["bert"]), "--max-queue", "0"]) == 2
    assert "--max-queue" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(folders["bert"]), "--max-items", "0"]) == 2
    assert "--max-items" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(folders["bert"]) + "-missing"]) == 2
    assert "not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------ in-process


class FailingTranslator:
    """A stand-in model: "boom" breaks it (a fault), "bad" is refused (bad input)."""

    kind = "translation"
    max_length = 100

    def endpoints(self) -> list[str]:
        return ["/v1/translate"]

    def token_count(self, line: str) -> int:
        return len(line.split()) + 1

    def run(self, key, lines: list[str]) -> list[str]:
        if "boom" in lines:
            raise RuntimeError("secret detail of the fault")
        if "bad" in lines:
            from attnlab.errors import AttnlabError

            raise AttnlabError("bad is not a sentence")
        return [line.upper() for line in lines]


class InProcess(Served):
    """An app under uvicorn in a thread of this process."""

    def __init__(self, app) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self._port = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> int:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        return 0


def test_a_fault_is_500_without_traceback_and_fails_only_its_request():
    from attnlab.serve import BatchSettings, create_app

    app = create_app(FailingTranslator(), "fake", BatchSettings(max_wait_ms=300))
    server = InProcess(app)
    try:
        status, answer = server.post("/v1/translate", {"input": "boom"})
        assert status == 500 and answer["error"] == {
            "message": "internal server error", "type": "server_error"}  # fmt: skip
        # Two requests in one batch: the bad one is refused, the other answered.
        results: dict[str, tuple[int, dict]] = {}
        threads = [threading.Thread(target=lambda t=text: results.__setitem__(
            t, server.post("/v1/translate", {"input": [t, "fine"]}))) for text in ("bad", "ok")]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert (
            results["bad"][0] == 422 and "not a sentence" in results["bad"][1]["error"]["message"]
        )
        assert results["ok"] == (200, results["ok"][1])
        assert [d["translation"] for d in results["ok"][1]["data"]] == ["OK", "FINE"]
        metrics = server.request("GET", "/metrics")[2].decode()
        assert re.search(r"^attnlab_batch_size_sum 5\.0$", metrics, re.MULTILINE)  # 1 + 4
    finally:
        server.stop()
