"""cli.py's VERBS: one entry per command the parser knows, each the `run(cfg, args)` of the job module
named for the verb (tiny-model: grpolab/jobs/tiny_model.py)."""

import importlib
import inspect
import subprocess
import sys

from grpolab.cli import VERBS, _parser


def test_every_command_has_its_jobs_run():
    commands = _parser()._subparsers._group_actions[0].choices
    assert list(VERBS) == list(commands)
    for verb, run in VERBS.items():
        module = importlib.import_module(f"grpolab.jobs.{verb.replace('-', '_')}")
        assert run is module.run, verb
        assert list(inspect.signature(run).parameters) == ["cfg", "args"], verb


def test_without_the_serve_extra_only_serve_fails_in_one_line(tmp_path):
    """Every job is imported with the CLI: a machine without FastAPI (the `serve` extra) still runs the other
    verbs, and `grpolab serve` says what to install."""
    blocked = "import sys\nfor m in ('fastapi', 'uvicorn', 'prometheus_client', 'starlette'): sys.modules[m] = None\n"
    cli = blocked + "from grpolab.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    ok = subprocess.run([sys.executable, "-c", cli, "tiny-model", str(tmp_path / "m")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    r = subprocess.run([sys.executable, "-c", cli, "serve", str(tmp_path / "m")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == ("grpolab: config error: grpolab serve needs the serve extra "
                                                      "(fastapi is not installed): pip install 'grpolab[serve]'")
