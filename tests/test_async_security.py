"""The wire between an async run's trainer and its rollout workers (rollout/link.py) is the run's alone: every
socket the run listens on is on loopback, and a message is read only when it carries the run's key, and then
(the model aside) without running any code."""

import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, wait_for_rows
from test_async import _args, _workers

from grpolab.rollout import link

LOOPBACK = ("127.0.0.1", "[::1]", "::1")


def _outside_address() -> tuple[str, str] | None:
    """(interface, IPv4 address) of this machine's first non-loopback interface, or None."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        return parts[1], parts[3].split("/")[0]
    return None


def _listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(local address, port, pid) of every TCP socket the processes `pids` listen on (ss -ltnp)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owner = next((p for p in pids if f"pid={p}," in line), None)
        if owner is not None:
            host, port = line.split()[3].rsplit(":", 1)
            found.append((host, int(port), owner))
    return found


@pytest.mark.slow
def test_an_async_run_listens_on_loopback_only(tmp_path):
    if shutil.which("ss") is None:
        pytest.skip("`ss` (iproute2) is not installed: the run's listening sockets cannot be listed")
    outside = _outside_address() if shutil.which("ip") else None
    # a user's GLOO_SOCKET_IFNAME (set for a multi-machine trainer) is no reason for the workers' wire to leave
    # the machine; without one, gloo listens where the hostname resolves, which may be any interface
    env = dict(os.environ, GLOO_SOCKET_IFNAME=outside[0]) if outside else dict(os.environ)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli",
                             *_args(tmp_path, out, "train.async_steps=1", "train.rollout_workers=2", steps=6,
                                    pause=0.3)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(out / "metrics.jsonl", 1, proc)   # the workers are up and the groups built
        pids = [proc.pid, *_workers(proc.pid)]
        listening = _listening(pids)
        reached = []
        for _, port, pid in listening if outside else []:   # from outside loopback nothing answers
            try:
                socket.create_connection((outside[1], port), timeout=5).close()
                reached.append((port, pid))
            except OSError:
                pass
    finally:
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert len(pids) == 3 and {p for _, _, p in listening} >= {proc.pid}, (pids, listening)
    assert all(host in LOOPBACK for host, _, _ in listening), listening
    assert not reached, f"reached from {outside}: {reached}"


class _RunsCode:
    """Unpickling this creates a file: proof that loading a message ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_message_without_the_runs_key_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    key, other = link.new_key(), link.new_key()
    assert key != other and len(key) == 32
    # sealed with another key (or with none: a bare torch.save): refused before a byte is unpickled
    bare = io.BytesIO()
    torch.save(_RunsCode(marker), bare)   # what the wire carried before it was sealed
    for forged in (torch.frombuffer(bytearray(bare.getvalue()), dtype=torch.uint8), link.seal(_RunsCode(marker), other),
                   link.seal(_RunsCode(marker), key)[:-1],
                   link.seal(_RunsCode(marker), key)[link.TAG:]):
        with pytest.raises(link.LinkError, match="not sealed with this run's key"):
            link.unseal(forged, key)
    # with the key, a command or result is still tensors and plain containers only
    with pytest.raises(pickle.UnpicklingError):
        link.unseal(link.seal(_RunsCode(marker), key), key)
    assert not marker.exists()
    # what the wire does carry comes back equal; the model message (code=True) as a whole module
    msg = {"batch": 3, "version": 1, "idle_s": 0.5, "error": None, "calls": [{"prompts": [[1, 2]], "stop_ids": (0,),
                                                                              "keys": torch.arange(4)}]}
    back = link.unseal(link.seal(msg, key), key)
    assert back["calls"][0]["keys"].equal(msg["calls"][0]["keys"]) and back["calls"][0]["stop_ids"] == (0,)
    assert {k: v for k, v in back.items() if k != "calls"} == {k: v for k, v in msg.items() if k != "calls"}
    model = torch.nn.Linear(3, 2)
    got = link.unseal(link.seal({"model": model}, key), key, code=True)["model"]
    assert isinstance(got, torch.nn.Linear) and got.weight.equal(model.weight)
