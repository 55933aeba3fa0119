"""lm-evaluation-harness against `grpolab serve`: its `local-completions` model (log-likelihoods from
/v1/completions with echo, the server's own tokenizer through /tokenizer_info and /tokenize) scores a
multiple-choice task and a perplexity task (loglikelihood_rolling, in windows) as its `hf` model scores
them on the export of the same checkpoint: the same accuracies, per-choice log-likelihoods and
perplexities to float tolerance. The task files are bench/lm_eval_tasks/, as docs/lm-eval.md runs them."""

import pytest
import torch
from conftest import ROOT, running_server

from grpolab.jobs.export import run_export as export
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.checkpoint import save_checkpoint

TASKS = ROOT / "bench" / "lm_eval_tasks"
MAX_LENGTH = 64   # the hf model's window; texts longer than it are scored in several (the second text is)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=128)).eval()
    tmp = tmp_path_factory.mktemp("lm_eval")
    ckpt = save_checkpoint(tmp / "checkpoints", 0, model, tokenizer=tok)
    export(str(ckpt), str(tmp / "export"))
    return tmp / "export"


def _tasks():
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml
    out = []
    for name in ("arith_choice", "text_perplexity"):
        cfg = load_yaml(TASKS / f"{name}.yaml")
        files = cfg["dataset_kwargs"]["data_files"]
        files["test"] = str(ROOT / files["test"])   # relative to the repository root, as the CLI runs it
        out.append(ConfigurableTask(config=cfg))
    return out


def _evaluate(lm):
    from lm_eval import simple_evaluate
    res = simple_evaluate(lm, tasks=_tasks(), log_samples=True)
    samples = {t: sorted(s, key=lambda x: x["doc_id"]) for t, s in res["samples"].items()}
    return res["results"], samples


@pytest.mark.slow
def test_local_completions_on_grpolab_serve_scores_as_hf_on_the_export(export_dir):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    want, want_samples = _evaluate(HFLM(pretrained=str(export_dir), max_length=MAX_LENGTH, batch_size=4,
                                        device="cpu", dtype="float32"))
    with running_server(export_dir, "--name", "tiny") as (url, _):
        # lm-eval's API models keep one token for generation and a rolling window one more: +2 gives the
        # same windows as hf's max_length
        lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model="tiny", max_length=MAX_LENGTH + 2,
                                 batch_size=4)
        assert lm.tokenizer_backend == "remote"   # found /tokenizer_info and /tokenize: the server's tokenizer
        got, got_samples = _evaluate(lm)
    mc, ppl = got["arith_choice"], got["text_perplexity"]
    assert mc["acc,none"] == want["arith_choice"]["acc,none"]
    assert mc["acc_norm,none"] == want["arith_choice"]["acc_norm,none"]
    for a, b in zip(got_samples["arith_choice"], want_samples["arith_choice"], strict=True):
        assert [ll for ll, _ in a["filtered_resps"]] == pytest.approx([ll for ll, _ in b["filtered_resps"]], abs=1e-4)
        assert [g for _, g in a["filtered_resps"]] == [g for _, g in b["filtered_resps"]]   # is_greedy
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ppl[metric] == pytest.approx(want["text_perplexity"][metric], rel=1e-5)
    for a, b in zip(got_samples["text_perplexity"], want_samples["text_perplexity"], strict=True):
        assert a["filtered_resps"][0] == pytest.approx(b["filtered_resps"][0], abs=1e-4)
    assert 1 < ppl["byte_perplexity,none"] < 200   # a real score, not a degenerate 0 or inf
