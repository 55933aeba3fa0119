"""The CLI's safety net for writes that fail (issue 34): a full disk or a read-only file system is one line and
exit 2 from any command, here `grpolab tiny-model` (transformers' and safetensors' writers), on a real tmpfs that
is full or read-only (`_mounted`: a private mount namespace; skipped where unavailable)."""

import errno
import shutil
import subprocess
import sys

import pytest
from test_serve_hardening import _mounted

from grpolab.cli import os_error_line
from grpolab.utils.files import torch_write_failed


def _last(r):
    # transformers' progress bar may precede the line; the error is the last line, and the only 'grpolab:' one
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("grpolab:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.slow
def test_a_full_disk_is_one_line(tmp_path):
    mnt = tmp_path / "full"
    r, _ = _mounted("size=64k", mnt, "tiny-model", str(mnt / "m"))
    assert r.returncode == 2
    assert _last(r) == f"grpolab: error: disk full while writing {mnt / 'm'} (No space left on device)"


@pytest.mark.slow
def test_a_read_only_file_system_is_one_line(tmp_path):
    mnt = tmp_path / "ro"
    r, left = _mounted("ro", mnt, "tiny-model", str(mnt / "m"))
    assert r.returncode == 2 and left == []
    assert _last(r) == f"grpolab: error: read-only file system: {mnt / 'm'}"


def test_torch_saves_failure_on_a_full_disk_is_recognised(tmp_path):
    """torch.save's writer on a full tmpfs raises a RuntimeError that names no errno: the CLI knows it."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    mnt = tmp_path / "full"
    mnt.mkdir()
    code = (f"import torch\ntry:\n    torch.save({{'x': torch.zeros(100000)}}, {str(mnt / 'x.pt')!r})\n"
            f"except RuntimeError as e:\n    print(str(e))\n")
    r = subprocess.run(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"',
                        str(mnt), sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 or not r.stdout.strip():
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr[-200:]}")
    assert torch_write_failed(RuntimeError(r.stdout.strip())), r.stdout
    assert not torch_write_failed(RuntimeError("CUDA out of memory"))


def test_os_error_lines_name_the_file_and_what_happened():
    """The words for each errno the safety net knows (EACCES cannot be produced for real as root)."""
    assert os_error_line(OSError(errno.ENOSPC, "No space left on device", "/d/out.jsonl")) == \
        "error: disk full while writing /d/out.jsonl (No space left on device)"
    assert os_error_line(OSError(errno.ENOSPC, "No space left on device")) == \
        "error: disk full while writing a file (No space left on device)"
    assert os_error_line(OSError(errno.EROFS, "Read-only file system", "/ro/x")) == \
        "error: read-only file system: /ro/x"
    assert os_error_line(PermissionError(errno.EACCES, "Permission denied", "/etc/x")) == \
        "error: permission denied: /etc/x"
    assert os_error_line(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")) == \
        "error: Invalid cross-device link: /a -> /b"
    assert os_error_line(OSError("We couldn't connect to the hub.\nCheck your connection")) == \
        "error: We couldn't connect to the hub. Check your connection"   # one line, whatever the message
