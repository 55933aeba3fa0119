"""Hardening of `grpolab serve`, `grpolab generate` and `grpolab export` (issue 34): the API key, non-finite
sampling values, the ceilings on a request's rows and on the waiting queue, and the one-line errors of a
bad port, a port in use, a read-only or full file system and an interruption.

Everything runs for real: a `grpolab serve` subprocess on 127.0.0.1 (one for the module), the `openai`
client and httpx, and file systems that really are read-only or full (a tmpfs mounted in a private mount
namespace with `unshare`; root ignores file modes, so chmod would test nothing).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import ROOT, run_cli, running_server
from test_serve import _builtin

from grpolab.errors import ConfigError
from grpolab.models import CharTokenizer
from grpolab.models.checkpoint import save_checkpoint
from grpolab.serve.generate import sampling_settings
from grpolab.serve.server import is_loopback

KEY = "sk-test-0123456789"
# the module's server: a key, and small ceilings that a few requests reach
LIMITS = ["--max-batch", "2", "--max-rows-per-request", "4", "--max-waiting", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a long context and no stop token (its logit 0 against large ones): a long request keeps the batch busy
    # until its client leaves, however the sampling goes
    model, tok = _builtin(block_size=4096, n_embd=64, n_layer=2), CharTokenizer()
    with torch.no_grad():
        model.lm_head.weight[list(tok.stop_ids)] = 0
    return save_checkpoint(tmp_path_factory.mktemp("serve_h") / "checkpoints", 0, model, tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt, "--name", "tiny", "--api-key", KEY, *LIMITS) as (url, proc):
        yield url
    assert proc.returncode == 0, proc.stdout.read()


def _client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _health(url):
    return httpx.get(url + "/health").json()


def _one_line(r):
    """The stderr lines of a CLI run that are not warnings."""
    return [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("grpolab: warning:")]


# ---- the API key -------------------------------------------------------------------------------------

def test_every_request_but_health_needs_the_key(server):
    assert httpx.get(server + "/health").status_code == 200   # open: load balancers probe it
    for key in ("wrong-key", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            _client(server, key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2)
        assert e.value.status_code == 401
        body = e.value.body   # OpenAI's error shape, as the server's other errors
        assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in body["message"] and "param" in body
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
        r = httpx.get(server + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    # the key is checked before the body is read: no validation error for a stranger
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401
    assert httpx.get(server + "/docs").status_code == 401
    # with the key (any case of 'Bearer'): served
    ok = _client(server).completions.create(model="tiny", prompt="2+2=", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    r = httpx.get(server + "/v1/models", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


@pytest.mark.slow
def test_the_key_can_come_from_the_environment(ckpt, monkeypatch):
    monkeypatch.setenv("GRPOLAB_API_KEY", "from-env")   # inherited by the server's process
    with running_server(ckpt, "--name", "tiny") as (url, proc):
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    assert proc.returncode == 0


@pytest.mark.slow
def test_a_non_loopback_host_without_a_key_is_warned_about(tmp_path):
    """The warning comes before the model loads (here: a missing one, so nothing is served)."""
    missing = tmp_path / "no_model"
    r = run_cli("serve", str(missing), "--host", "0.0.0.0", "--port", "0", timeout=120)
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("grpolab: warning:")]
    assert len(warn) == 1 and "0.0.0.0 without an API key" in warn[0] and "--api-key" in warn[0], r.stderr
    assert r.returncode == 2 and _one_line(r) and str(missing) in _one_line(r)[0]
    r = run_cli("serve", str(missing), "--port", "0", "--host", "0.0.0.0", "--api-key", "k", timeout=120)
    assert r.returncode == 2 and "warning" not in r.stderr, r.stderr
    # which hosts count as this machine only
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


# ---- sampling values and ceilings ---------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("temperature", "1e999"), ("temperature", "Infinity"),
                                         ("temperature", "NaN"), ("top_p", "-Infinity"), ("top_p", "NaN")])
def test_non_finite_sampling_values_are_refused(server, field, value):
    # raw JSON: 1e999 parses as inf, and Python's parser takes NaN/Infinity too
    body = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, '
            f'"{field}": {value}}}')
    r = httpx.post(server + "/v1/chat/completions", content=body.encode(),
                   headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and field in err["message"]


def test_generate_refuses_non_finite_sampling_values(ckpt, tmp_path):
    for value in (".inf", "-.inf", ".nan", "1.0e+999"):   # YAML's spellings, as the CLI parses them
        with pytest.raises(ConfigError, match="temperature: temperature must be a finite number"):
            sampling_settings([f"temperature={value}"])
        with pytest.raises(ConfigError, match=r"top_p: top_p must be in \(0, 1\]"):
            sampling_settings([f"top_p={value}"])
    # through the CLI: one line, before the model loads
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    r = run_cli("generate", str(ckpt), "--in", str(inp), "--out", str(tmp_path / "o.jsonl"), "temperature=1.0e+999")
    assert r.returncode == 2 and len(_one_line(r)) == 1 and "Traceback" not in r.stderr, r.stderr
    assert _one_line(r)[0] == "grpolab: config error: temperature: temperature must be a finite number >= 0 " \
                              "(0 = greedy), got inf"
    assert not (tmp_path / "o.jsonl").exists()


def test_a_vanishing_temperature_is_greedy(server):
    """1e-300 is finite but overflows the tempered float32 logits; it samples as 0 does (greedy)."""
    c = _client(server)
    greedy = c.completions.create(model="tiny", prompt="12+7=", max_tokens=12, temperature=0, logprobs=0)
    for t in (1e-300, 1e-6):
        r = c.completions.create(model="tiny", prompt="12+7=", max_tokens=12, temperature=t, logprobs=0, seed=1)
        assert r.choices[0].text == greedy.choices[0].text
        assert r.choices[0].logprobs.token_logprobs == greedy.choices[0].logprobs.token_logprobs   # no NaN
    assert all(lp == lp for lp in greedy.choices[0].logprobs.token_logprobs)


def test_a_request_of_too_many_rows_is_refused_at_once(server):
    c = _client(server)
    with pytest.raises(openai.BadRequestError) as e:   # 3 prompts x n=2 = 6 rows > 4
        c.completions.create(model="tiny", prompt=["a", "b", "c"], n=2, max_tokens=3)
    body = e.value.body
    assert body["code"] == "request_too_large" and body["param"] == "prompt"
    assert "3 prompts × n=2 = 6 rows" in body["message"] and "at most 4 rows" in body["message"]
    assert "--max-rows-per-request" in body["message"]
    # the probe's request, 2,000 prompts x n=64: refused before any tokenizing, in well under a second
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=["What is 2+2?"] * 2000, n=64, max_tokens=400)
    assert time.perf_counter() - t0 < 2.0
    assert "2000 prompts × n=64 = 128000 rows" in e.value.body["message"]
    # a request at the ceiling is served
    r = c.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=3, temperature=0)
    assert len(r.choices) == 4


def test_a_full_queue_gets_429_and_frees_when_rows_leave(server):
    c = _client(server)
    long = {"model": "tiny", "prompt": "a", "max_tokens": 4000, "temperature": 1.0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server + "/v1/completions", json={**long, "n": 2}, headers=headers,
                      timeout=120) as running:
        lines = running.iter_lines()   # kept open (a closed iterator would hang up)
        while not next(lines).startswith("data: "):   # its first token: the batch (max 2 rows) is full
            pass
        # 4 rows that must wait (the most --max-waiting allows): two requests of n=2, from other threads
        answers = []
        waiters = [threading.Thread(target=lambda: answers.append(httpx.post(
            server + "/v1/completions", headers=headers, timeout=120,
            json={**long, "n": 2, "stream": False, "max_tokens": 5}).status_code)) for _ in range(2)]
        for w in waiters:
            w.start()
        for _ in range(200):
            if _health(server)["waiting_rows"] == 4:
                break
            time.sleep(0.02)
        h = _health(server)
        assert (h["running"], h["waiting_rows"]) == (2, 4), h
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="tiny", prompt="b", max_tokens=3)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        body = e.value.body
        assert body["code"] == "queue_full" and "--max-waiting" in body["message"]
        assert "4 rows are waiting" in body["message"] and "adds 1" in body["message"]
    # the stream closed: its rows leave, the waiting request runs, and new requests are taken again
    for w in waiters:
        w.join(timeout=60)
    assert answers == [200, 200] and _health(server)["waiting_rows"] == 0
    r = c.completions.create(model="tiny", prompt="b", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_ceilings_are_checked_at_startup(ckpt):
    r = run_cli("serve", str(ckpt), "--port", "0", "--max-rows-per-request", "10", "--max-waiting", "5")
    assert r.returncode == 2 and len(_one_line(r)) == 1
    assert "--max-rows-per-request (10) must not exceed --max-waiting (5)" in r.stderr
    r = run_cli("serve", str(ckpt), "--port", "0", "--max-waiting", "0")
    assert r.returncode == 2 and _one_line(r) == [
        "grpolab: usage error: argument --max-waiting: must be >= 1, got 0 (see grpolab serve --help)"]
    for bad in ("8", "-16"):   # a chunk ends on a 16-token block boundary: it must hold one
        r = run_cli("serve", str(ckpt), "--port", "0", "--prefill-chunk", bad)
        assert r.returncode == 2 and len(_one_line(r)) == 1
        assert f"--prefill-chunk must be 0 (no limit) or at least 16 tokens, got {bad}" in r.stderr
    r = run_cli("serve", str(ckpt), "--port", "0", "--kernel-cache", "0")   # PyTorch crashes on an empty cache
    assert r.returncode == 2 and _one_line(r) == [
        "grpolab: usage error: argument --kernel-cache: must be >= 1, got 0 (see grpolab serve --help)"]


def test_generate_n_above_the_batch_is_refused(ckpt, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    r = run_cli("generate", str(ckpt), "--in", str(inp), "--out", str(tmp_path / "o.jsonl"), "--n", "1000000000",
                "--max-batch", "4")
    assert r.returncode == 2 and _one_line(r) == [
        "grpolab: usage error: --n 1000000000 is more than --max-batch 4: raise --max-batch "
        "(see grpolab generate --help)"]


# ---- ports ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("port,why", [("99999", "must be between 0 and 65535"), ("-1", "must be between"),
                                      ("http", "'http' is not a port number")])
def test_a_bad_port_is_one_usage_line(ckpt, port, why):
    r = run_cli("serve", str(ckpt), "--port", port)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: usage error: argument --port: {why}"), r.stderr
    assert lines[0].endswith("(see grpolab serve --help)")


def test_a_port_in_use_is_one_line_before_the_model_loads(ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.perf_counter()
        r = run_cli("serve", str(ckpt), "--port", str(port))
        took = time.perf_counter() - t0
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert _one_line(r) == [f"grpolab: config error: --port {port}: the port is already in use on 127.0.0.1 "
                            f"(another server?); pick another port"], r.stderr
    assert "serving" not in r.stdout and took < 30   # refused before loading the model


@pytest.mark.slow
def test_port_zero_serves_on_a_free_port_and_says_which(ckpt):
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "serve", str(ckpt), "--port", "0", "--name", "z",
                             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("grpolab: serving 'z'"), line
        url = line.rsplit(" at ", 1)[1].strip().removesuffix("/v1")
        assert not url.endswith(":0")
        for _ in range(300):
            try:
                assert httpx.get(url + "/health").json()["status"] == "ok"
                break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise AssertionError("not serving")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


# ---- file systems that refuse writes -------------------------------------------------------------------

MOUNTED = """mount -t tmpfs -o "$1" tmpfs "$2" || exit 99
shift 2
"$@"
rc=$?
echo "left: $(ls -A "$MNT")"
exit $rc
"""


def _mounted(opts, mnt, *cli):
    """Run the CLI with a fresh tmpfs (mount options `opts`: ro, or a tiny size) at `mnt`, in a private mount
    namespace; skip where this machine cannot (no unshare, no privilege)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    mnt.mkdir(exist_ok=True)
    r = subprocess.run(["unshare", "--mount", "sh", "-c", MOUNTED, "sh", opts, str(mnt),
                        sys.executable, "-m", "grpolab", *cli], capture_output=True, text=True, cwd=ROOT,
                       timeout=600, env={**os.environ, "MNT": str(mnt)})
    if r.returncode == 99 or "unshare failed" in r.stderr or "Operation not permitted" in r.stderr[:200]:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {r.stderr.strip()[:200]}")
    left = r.stdout.rsplit("left: ", 1)[1].strip().split()
    return r, left


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("gen_in") / "in.jsonl"
    # a wide column: 8 rows of output need more than 8 KiB
    p.write_text("".join(json.dumps({"prompt": f"{i}+1=", "pad": "x" * 3000}) + "\n" for i in range(8)))
    return p


def test_generate_on_a_read_only_file_system_is_one_line(ckpt, prompts_file, tmp_path):
    mnt = tmp_path / "ro"
    r, left = _mounted("ro", mnt, "generate", str(ckpt), "--in", str(prompts_file), "--out", str(mnt / "out.jsonl"),
                       "max_tokens=4")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert _one_line(r) == [f"grpolab: error: read-only file system: {mnt / 'out.jsonl'}"], r.stderr
    assert "rows to do" not in r.stdout   # found before the model loaded


def test_generate_on_a_full_disk_is_one_line_and_keeps_whole_rows(ckpt, prompts_file, tmp_path):
    mnt = tmp_path / "full"
    r, left = _mounted("size=8k", mnt, "generate", str(ckpt), "--in", str(prompts_file), "--out",
                       str(mnt / "out.jsonl"), "max_tokens=4", "temperature=0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert _one_line(r) == [f"grpolab: error: disk full while writing {mnt / 'out.jsonl'} (No space left on device)"]
    assert left == ["out.jsonl"]


def test_export_on_a_read_only_file_system_is_one_line(ckpt, tmp_path):
    mnt = tmp_path / "ro"
    r, left = _mounted("ro", mnt, "export", str(ckpt), str(mnt / "export"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert _one_line(r) == [f"grpolab: export error: read-only file system: cannot write {mnt / 'export'}"]
    assert left == []


@pytest.mark.slow
def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(ckpt, tmp_path):
    mnt = tmp_path / "full"
    r, left = _mounted("size=64k", mnt, "export", str(ckpt), str(mnt / "export"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert _one_line(r) == [f"grpolab: export error: disk full while writing {mnt / 'export'}; "
                            f"the partial export was removed"], r.stderr
    assert left == []   # no half-written model directory


# ---- interruptions -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_says_interrupted_not_a_blank_line(ckpt, tmp_path):
    """SIGINT while generate waits for its input (a FIFO nobody writes yet): a bare KeyboardInterrupt."""
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "generate", str(ckpt), "--in", str(fifo), "--out",
                             str(tmp_path / "o.jsonl")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    fd = None
    try:
        for _ in range(600):   # a writer can open the FIFO once the reader has: generate is reading it
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                time.sleep(0.05)
        assert fd is not None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if fd is not None:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err == "grpolab: interrupted\n", err


@pytest.mark.slow
def test_ctrl_c_in_generate_says_what_was_kept(ckpt, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(400)))
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "generate", str(ckpt), "--in", str(inp), "--out",
                             str(out), "--max-batch", "2", "max_tokens=8", "temperature=1.0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "400 rows to do" in line, line
        for _ in range(600):   # until some rows are written
            if out.exists() and out.read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    kept = len(out.read_text().splitlines())
    assert proc.returncode == 130 and 2 <= kept < 400
    assert err == (f"grpolab: interrupted: {kept} of 400 rows are in {out}; run the same command again "
                   f"to do the rest\n"), err
