"""A judge that cannot give scores stops the run with one line that says why, against real HTTP servers
in the test (a tiny http.server thread): a port nothing listens on, a server that answers 500, one that
hangs, one whose answers are not chat completions. One that fails only some requests gives None for
those (counted), as documented; one that works gives its scores."""

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpolab.config.load import load_config
from grpolab.errors import RewardError
from grpolab.rewards import judge
from grpolab.rewards.calling import RewardLog
from grpolab.rewards.combine import score

OK = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
      "choices": [{"index": 0, "message": {"role": "assistant", "content": "Score: 7"}, "finish_reason": "stop"}]}


class Judge:
    """An HTTP server on 127.0.0.1 answering every POST by `reply(body text) -> (status, bytes)`, or never
    (`hang`); it counts the requests it got."""

    def __init__(self, reply=None, hang: bool = False) -> None:
        self.reply, self.hang, self.requests = reply, hang, 0
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.requests += 1
                text = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                if outer.hang:
                    outer.release.wait(60)
                    return
                status, data = outer.reply(text)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _configure(url: str, **kw) -> None:
    over = {"base_url": url, "model": "m", "template": "Rate: {completion}", "max_retries": 1, "backoff": 0.05,
            "cache": False, **kw}
    cfg = load_config(None, [f"reward.judges.t.{k}={json.dumps(v)}" for k, v in over.items()] +
                      ["reward.functions=[judge:t]"])
    judge.configure(cfg.reward, None)


def _score(completions: list[str]) -> tuple[list, dict]:
    log = RewardLog(len(completions))
    _, per = score(["judge:t"], None, ["q"] * len(completions), completions, {}, log=log, timeout=120)
    return [None if math.isnan(x) else x for x in per["judge:t"].tolist()], log.mean_metrics()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    return port


def _stopped(url: str, why: str, n: int = 2, tries: int = 2) -> str:
    return (f"reward judge:t: the judge at {url} answered none of this step's {n} requests, each tried {tries} times "
            f"(reward.judges.t.max_retries = {tries - 1}): {why}; start or fix the judge server (train.resume=auto "
            f"continues from the last checkpoint)")


def test_an_unreachable_judge_stops_the_run():
    url = f"http://127.0.0.1:{_free_port()}/v1"
    _configure(url)
    with pytest.raises(RewardError) as e:
        _score(["one", "two"])
    assert str(e.value) == _stopped(url, "cannot connect (connection refused)")


def test_a_judge_that_answers_500_stops_the_run_with_the_first_bytes_of_its_answer():
    body = b'{"error": "CUDA out of memory while loading the judge model; ' + b"x" * 200 + b'"}'
    with Judge(lambda _: (500, body)) as srv:
        _configure(srv.url)
        with pytest.raises(RewardError) as e:
            _score(["one", "two"])
        assert srv.requests == 4   # two requests, each tried twice
    first = repr(body[:80].decode())
    assert str(e.value) == _stopped(srv.url, f"HTTP 500 {first} (first 80 of {len(body)} bytes)")


def test_a_judge_that_hangs_stops_the_run_at_its_timeout():
    with Judge(hang=True) as srv:
        _configure(srv.url, timeout=0.5, max_retries=0)
        with pytest.raises(RewardError) as e:
            _score(["one", "two", "three"])
    assert str(e.value) == _stopped(srv.url, "no answer within 0.5 s (reward.judges.t.timeout)", n=3, tries=1)


@pytest.mark.parametrize("status,body,what", [
    (200, b"<html><body>Welcome to nginx!</body></html>", "not JSON"),
    (200, b'{"choices": [{"message": {"content": ', "not JSON"),
    (200, b'{"result": "Score: 7"}', "JSON without choices[0].message.content"),
    (200, b'{"choices": "Score: 7"}', "JSON without choices[0].message.content"),
    (200, b'{"choices": [{"message": {"content": 7}}]}', "JSON without choices[0].message.content"),
    (200, b'[1, 2]', "JSON without choices[0].message.content"),
])
def test_a_malformed_answer_is_one_line_with_its_first_bytes(status, body, what):
    with Judge(lambda _: (status, body)) as srv:
        _configure(srv.url)
        with pytest.raises(RewardError) as e:
            _score(["one"])
    assert str(e.value) == (f"reward judge:t: the judge's answer is malformed ({what}): {body.decode()!r}; check "
                            f"that reward.judges.t.base_url ({srv.url}) is an OpenAI-compatible API")


def test_a_judge_failing_some_requests_gives_none_for_those_and_scores_the_rest():
    def reply(text):
        return (500, b'{"error": "busy"}') if "bad" in text else (200, json.dumps(OK).encode())
    with Judge(reply) as srv:
        _configure(srv.url)
        got, metrics = _score(["good one", "bad one", "good two"])
    assert got == [pytest.approx(0.7), None, pytest.approx(0.7)]
    assert metrics == {"judge/t/requests": 4, "judge/t/cached": 0, "judge/t/failed": 1, "judge/t/unparsed": 0}
