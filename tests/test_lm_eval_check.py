"""bench/lm_eval_check.py and bench/lm_eval_tasks/: lm-evaluation-harness's `hf` model and `grpolab eval`
render the same prompt ids, write the same greedy completions and score them alike, on a real Hugging Face
model (a tiny Llama taught four answers on the spot, so that some are right and some wrong)."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import GSM8K_SAMPLE, ROOT

from grpolab.models.hf import HFTokenizer
from grpolab.models.tiny_hf import save_tiny_model

pytest.importorskip("lm_eval")

SCRIPT = ROOT / "bench" / "lm_eval_check.py"
SYSTEM = "Answer with '#### <number>'."
# what the model is taught to answer to the first four GSM8K_SAMPLE test problems (references 4, 13500,
# -7, 4.5): right, right with a thousands separator, wrong (the sign), right written '4.50'
TAUGHT = ["#### 4", "The town has\n#### 13,500", "#### 7", "#### 4.50"]
RIGHT = [True, True, False, True]
# lm-eval's stock GSM8K rule compares the text after '#### ' without ',' '$' and a final '.': '4.50' is not '4.5'
STRICT = [True, True, False, False]


def _load(name, path):
    """A module from a file of bench/ (not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _taught_model(path):
    """A tiny Llama trained (full batch, Adam) until its greedy answer to each chat-templated problem is TAUGHT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    save_tiny_model(path, hidden=64, layers=2, heads=2, intermediate=128)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(path))
    seqs = [(tok.render_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]),
             tok.render_completion(c)) for (q, _, _), c in zip(GSM8K_SAMPLE["test"], TAUGHT)]
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), width), tok.pad_id)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        mask[i, :len(p) + len(c)] = 1
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(150):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(path)
    return path


@pytest.mark.slow
def test_lm_eval_and_grpolab_agree_problem_by_problem(tmp_path, gsm8k_dir):
    model = _taught_model(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    check = _load("lm_eval_check", SCRIPT)
    threads = torch.get_num_threads()
    try:   # in this process (lm-eval's import paid once); `grpolab eval` still runs in its own
        res = check.compare(model, gsm8k_dir, 4, system_prompt=SYSTEM, max_new_tokens=12, batch_size=4,
                            threads=1, check_prompts=4, out=out)
    finally:
        torch.set_num_threads(threads)
    json.dumps(res)   # the line the script prints
    rows = [json.loads(line) for line in (out / "per_problem.jsonl").read_text().splitlines()]
    assert [r["grpolab"] for r in rows] == TAUGHT   # the model learned its answers, as grpolab decodes them
    assert [r["lm_eval"] for r in rows] == TAUGHT   # ... and as lm-eval decodes them
    assert [r["grpolab_correct"] for r in rows] == RIGHT
    assert [r["lm_eval_correct"] for r in rows] == RIGHT
    assert res["n"] == 4 and res["prompts_checked"] == 4 and res["prompts_equal"] == 4
    assert res["same_completion"] == 4 and res["same_correctness"] == 4
    p = sum(RIGHT) / 4
    assert res["grpolab"]["accuracy"] == res["lm_eval"]["accuracy"] == p
    assert res["lm_eval"]["se"] == pytest.approx(math.sqrt(p * (1 - p) / 4))
    assert res["lm_eval"]["strict_match"] == sum(STRICT) / 4
    assert res["difference"] == 0.0 and res["within_one_se"] is True


def test_the_task_reads_answers_as_grpolab_does():
    utils = _load("gsm8k_local_utils", ROOT / "bench" / "lm_eval_tasks" / "utils.py")
    cases = [  # (completion, reference solution, grpolab's reader, lm-eval's stock strict-match)
        ("So 12 in all.\n#### 12\nThe answer is 3", "12 - 0 = 12\n#### 12", 1.0, 1.0),
        ("#### 7\nNo, wait.\n#### 8", "... #### 8", 1.0, 0.0),    # the LAST '####' counts; strict takes the first
        ("#### $1,000.", "... #### 1000", 1.0, 0.0),              # '$' after '#### ' defeats the stock regex
        ("#### 1,00", "... #### 100", 0.0, 1.0),                  # '1,00' is 1 to grpolab (not a thousands group)
        ("The answer is 18.", "... #### 18", 0.0, 0.0),           # no '####': no answer
    ]
    for completion, solution, acc, strict in cases:
        got = utils.process_results({"question": "q", "answer": solution}, [completion])
        assert got == {"acc": acc, "strict_match": strict}, completion


def test_the_math_task_reads_answers_as_grpolab_does():
    utils = _load("gsm8k_local_utils", ROOT / "bench" / "lm_eval_tasks" / "utils.py")
    solution = "The difference is $36 - 26 = \\boxed{10}$."
    cases = [("So it is \\boxed{10}.", solution, 1.0),
             ("So it is \\boxed{\\frac{20}{2}}.", solution, 1.0),   # the same value
             ("So it is \\boxed{11}.", solution, 0.0),
             ("So it is 10.", "no boxed answer here", 0.0)]             # an unreadable reference counts wrong
    for completion, reference, acc in cases:
        assert utils.process_results_math({"problem": "q", "solution": reference}, [completion]) == {"acc": acc}


def test_a_missing_data_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "model"), "--data", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"lm_eval_check: error: {tmp_path}: no test.jsonl (gsm8k rows); "
        f"python scripts/gsm8k_easy.py writes data/gsm8k_easy"]
