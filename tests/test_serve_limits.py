"""The server's size limits (issue 48): a body over --max-request-bytes is a 413 before it is read (a 150 MB
prompt cost 25 s, 2.6 GB and every other request's turn), and a text that cannot fit the context is a 400
before it is tokenized. A real `grpolab serve` subprocess, raw sockets and httpx."""

import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from conftest import running_server
from test_serve import _builtin

from grpolab.models import CharTokenizer
from grpolab.models.checkpoint import save_checkpoint
from grpolab.models.hf import HFTokenizer
from grpolab.models.tiny_hf import build_tokenizer, save_tiny_model
from grpolab.serve.requests import MAX_REQUEST_BYTES, SLACK
from grpolab.serve.tokenize import longest_token_chars

KEY = "sk-limits-0123456789"
LIMIT = 100_000
CONTEXT = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("serve_limits") / "checkpoints", 0,
                           _builtin(block_size=CONTEXT, n_embd=32, n_layer=1), tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt, "--name", "tiny", "--api-key", KEY, "--max-request-bytes", str(LIMIT)) as (url, proc):
        yield url, proc


def _post(url, body: bytes, **headers):
    return httpx.post(url + "/v1/completions", content=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers})


def _response(s: socket.socket) -> str:
    """A whole HTTP response read from `s` (headers, then Content-Length bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
    while len(body) < length:
        more = s.recv(65536)
        if not more:
            break
        body += more
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def _completion(text: str) -> bytes:
    return ('{"model": "tiny", "max_tokens": 1, "prompt": "' + text + '"}').encode()


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(server):
    """150 MB declared, a few bytes sent: the 413 arrives anyway, so the server never waited for the body."""
    url, _ = server
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=120) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {150 * 2**20}\r\n\r\n".encode()
                  + _completion("x")[:20])
        head = _response(s)
    assert head.startswith("HTTP/1.1 413"), head
    assert "request_too_large" in head and "--max-request-bytes" in head and str(LIMIT) in head, head
    assert httpx.get(url + "/health").status_code == 200


def test_a_chunked_body_over_the_limit_is_refused(server):
    url, _ = server

    def chunks():   # no Content-Length: the server counts as it reads
        yield _completion("")[:-2]
        for _ in range(50):
            yield b"y" * 10_000
        yield b'"}'

    r = _post(url, chunks())
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and f"more than {LIMIT} bytes" in err["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_a_body_under_the_limit_still_works_and_the_key_comes_first(server):
    url, _ = server
    r = _post(url, _completion("1 + 1 ="))
    assert r.status_code == 200, r.text
    # without the key: 401, not 413, even for a body over the limit (nothing is told to a stranger)
    r = httpx.post(url + "/v1/completions", content=b"x" * (LIMIT + 1), timeout=120)
    assert r.status_code == 401


def test_a_text_longer_than_the_context_can_hold_is_refused_before_tokenizing(server):
    url, _ = server
    most = SLACK * CONTEXT * longest_token_chars(CharTokenizer())
    assert most < LIMIT   # the body passes the byte limit: the length check is what refuses it
    r = _post(url, _completion("z" * (most + 1)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert f"the prompt is {most + 1} characters" in err["message"] and f"{CONTEXT} tokens" in err["message"]
    # the same for the messages of a chat request, counted together
    half = "w" * (most // 2 + 1)
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": half},
                                                                        {"role": "user", "content": half}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # a text a little shorter is tokenized and meets the token check instead (a different message)
    r = _post(url, _completion("z" * (CONTEXT + 5)))
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] != "context_length_exceeded"


def test_the_longest_token_bounds_what_a_token_stands_for():
    """Each token of a real byte-level BPE tokenizer (and each special token) decodes to at most
    longest_token_chars characters, so the length check never refuses a text that could fit."""
    tok = HFTokenizer(build_tokenizer(vocab_size=512))
    bound = longest_token_chars(tok)
    decoded = [tok.tok.decode([i]) for i in range(len(tok.tok))]
    assert max(len(t) for t in decoded) <= bound
    assert bound < 64   # and it is a bound, not a number so large that it checks nothing


def test_the_default_limit_is_said_at_start(ckpt):
    with running_server(ckpt, "--name", "tiny") as (url, proc):
        u = urlparse(url)
        with socket.create_connection((u.hostname, u.port), timeout=120) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {MAX_REQUEST_BYTES + 1}\r\n\r\n{{".encode())
            assert _response(s).startswith("HTTP/1.1 413")
        with socket.create_connection((u.hostname, u.port), timeout=120) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {MAX_REQUEST_BYTES}\r\n\r\n{{".encode())
            s.settimeout(1.0)
            with pytest.raises(TimeoutError):   # at the limit: the server waits for the rest of the body
                s.recv(65536)
    assert f"bodies up to {MAX_REQUEST_BYTES} bytes" in proc.stdout.read()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve_limits_hf") / "llama", vocab_size=300, max_positions=CONTEXT,
                           layers=1, hidden=32, heads=2, intermediate=64)


def test_health_answers_while_a_long_request_is_tokenized(hf_model):
    """Prompts each just short enough to pass the length check, 2 MB in all (under the default body limit),
    take the tokenizer seconds: /health answers meanwhile and counts the request as preparing. On the event
    loop, the tokenizer held every other request (/health waited 24.9 s behind a 150 MB prompt)."""
    from transformers import AutoTokenizer

    each = SLACK * CONTEXT * longest_token_chars(HFTokenizer(AutoTokenizer.from_pretrained(hf_model)))
    prompts = ["the cat sat on 12 mats. " * (each // 24)] * (2_000_000 // each)
    body = {"model": "tiny", "max_tokens": 1, "prompt": prompts}
    with running_server(hf_model, "--name", "tiny") as (url, _):
        answer = {}
        big = threading.Thread(target=lambda: answer.update(r=httpx.post(url + "/v1/completions", json=body,
                                                                          timeout=600)))
        big.start()
        seen = []
        while big.is_alive():
            h = httpx.get(url + "/health", timeout=600).json()
            seen.append(h["preparing"])
            if h["preparing"]:
                break
            time.sleep(0.01)
        big.join()
        assert 1 in seen, f"/health never answered while the request was prepared: {seen}"
        r = answer["r"]   # and the request itself got its answer: too many tokens for the context, a 400
        assert r.status_code == 400 and f"context is {CONTEXT} tokens" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health").json()["preparing"] == 0
