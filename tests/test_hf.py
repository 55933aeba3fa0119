"""Hugging Face models through our engine, trainer, checkpoints and CLI, on a tiny Llama built here."""

import json

import pytest
import torch
from conftest import run_cli

from grpolab.data.tasks import arithmetic
from grpolab.models.hf import load_hf
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    rows = arithmetic.generate("train", 300, seed=0)
    texts = [r["prompt"] + "\n" + r["answer"] for r in rows]
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", texts, vocab_size=300,
                           hidden=32, layers=2, heads=2, intermediate=64)


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_hf(str(tiny_dir))


def test_prompts_render_through_chat_template_or_as_text(policy):
    _, tok = policy
    chat = tok.render_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
    assert tok.decode(chat, skip_special=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    plain = tok.render_prompt("Mia has 7 shells.")
    assert tok.decode(plain, skip_special=False) == "Mia has 7 shells."
    assert tok.eos_id in tok.stop_ids and tok.pad_id != tok.eos_id


def test_greedy_decoding_matches_transformers_generate(policy):
    """Our batched, left-padded KV-cache decode gives the same tokens as HF generate on each prompt alone."""
    model, tok = policy
    prompts = [tok.render_prompt(p) for p in ["Mia has 7 shells.", "Leo has 12 coins, loses 3. How many now?",
                                              [{"role": "user", "content": "Ava has 5 pens."}]]]
    ours = generate(model, prompts, max_new_tokens=12, temperature=0.0, stop_ids=(), pad_id=tok.pad_id)
    for i, p in enumerate(prompts):
        ref = model.hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_id)
        assert ours.completion_ids[i].tolist() == ref[0, len(p):].tolist()


def test_sampler_logprobs_equal_recomputed_logprobs(policy):
    model, tok = policy
    prompts = [tok.render_prompt(p) for p in ["Mia has 7 shells.", "Leo has 12 coins, loses 3, finds 4 more."]]
    g = generate(model, prompts, num_generations=3, max_new_tokens=10, temperature=0.7, stop_ids=tok.stop_ids,
                 pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    lp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, 0.7)
    assert g.completion_mask.any()
    torch.testing.assert_close(lp, g.sampler_logprobs, atol=1e-5, rtol=0)


def test_bf16_loads_and_generates(tiny_dir):
    model, tok = load_hf(str(tiny_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    g = generate(model, [tok.render_prompt("Mia has 7 shells.")], num_generations=2, max_new_tokens=5,
                 stop_ids=tok.stop_ids, pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(g.sampler_logprobs).all()


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(str(tmp_path / "nope"))


def _gsm8k_file(path, rows):
    with open(path, "w") as f:
        for r in rows:
            steps = r["answer"].rsplit("\n", 1)[0]
            f.write(json.dumps({"question": r["prompt"], "answer": f"{steps}\n#### {r['answer'].split()[-1]}"}) + "\n")


@pytest.mark.slow
def test_train_then_eval_through_the_cli(tiny_dir, tmp_path):
    """GRPO steps on a GSM8K-format file, checkpoint in HF layout, then `grpolab eval` on it."""
    from transformers import AutoModelForCausalLM

    _gsm8k_file(tmp_path / "train.jsonl", arithmetic.generate("train", 40, seed=1))
    _gsm8k_file(tmp_path / "test.jsonl", arithmetic.generate("test", 6, seed=1))
    out = tmp_path / "run"
    r = run_cli("train", f"model.name_or_path={tiny_dir}", "data.task=gsm8k", f"data.train_path={tmp_path}",
                "data.prompt_suffix=Answer after ####.", "rollout.prompts_per_step=2", "rollout.num_generations=4",
                "rollout.max_new_tokens=8", "reward.functions=[gsm8k_accuracy,format]", "algorithm.beta=0.04",
                "train.max_steps=2", f"train.output_dir={out}", "eval.num_problems=4", "eval.k=2",
                "train.threads=1")
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert {"rewards/gsm8k_accuracy/mean", "rewards/format/mean", "kl", "reward"} <= set(metrics[0])
    ckpt = out / "checkpoints" / "step_2"
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt))   # loads with plain transformers
    trained, _ = load_hf(str(ckpt))
    for (n, a), b in zip(hf.state_dict().items(), trained.hf.state_dict().values()):
        assert torch.equal(a, b), n

    ev = tmp_path / "eval"
    r = run_cli("eval", str(ckpt), "--out", str(ev), "data.task=gsm8k", f"data.train_path={tmp_path}",
                "data.prompt_suffix=Answer after ####.", "rollout.max_new_tokens=8", "eval.num_problems=3", "eval.k=2")
    assert r.returncode == 0, r.stderr
    res = json.loads((ev / "eval.json").read_text())
    # the accuracies, and each reward function's mean on the greedy completions
    assert {k for k in res if not k.startswith("rewards/")} == {"greedy_accuracy", "pass@1", "pass@2", "maj@2"}
    assert "rewards/gsm8k_accuracy/mean" in res
    assert all(k in r.stdout for k in res)   # the printed table
    samples = [json.loads(line) for line in (ev / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["samples"]) == 2 for s in samples)
    assert "Answer after ####." in samples[0]["prompt"]

    # without the data flags, eval uses the run's config.yaml (its data, prompt suffix, eval settings)
    r = run_cli("eval", str(ckpt), "--out", str(tmp_path / "eval2"))
    assert r.returncode == 0, r.stderr
    assert "config.yaml (the run's config" in r.stderr
    samples = [json.loads(line) for line in (tmp_path / "eval2" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(len(s["samples"]) == 2 for s in samples)   # the run's eval.num_problems, k
    assert all(s["prompt"].endswith("Answer after ####.") for s in samples)

    # the checkpoint is served as it is (the lean decode path), answering as the engine does
    from test_serve import serve_and_compare
    serve_and_compare(ckpt, [s["prompt"] for s in samples[:2]])


def test_trainer_logprobs_equal_a_plain_forward_per_row(policy):
    """Padded batch log-probs == log_softmax of a plain unpadded `model(input_ids).logits`, gathered."""
    model, tok = policy
    prompts = [tok.render_prompt(p) for p in ["Mia has 7 shells.", "Leo has 12 coins, loses 3, finds 4 more."]]
    g = generate(model, prompts, num_generations=2, max_new_tokens=9, stop_ids=tok.stop_ids, pad_id=tok.pad_id,
                 generator=torch.Generator().manual_seed(1))
    lp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    for i in range(len(g.completion_ids)):
        p = g.prompt_ids[i][g.prompt_mask[i]]
        c = g.completion_ids[i][g.completion_mask[i]]
        ids = torch.cat([p, c])[None]
        with torch.no_grad():
            plain = model.hf(ids).logits.log_softmax(-1)[0, len(p) - 1:-1].gather(-1, c[:, None]).squeeze(-1)
        torch.testing.assert_close(lp[i][g.completion_mask[i]], plain, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tiny_model_cli_then_gsm8k_tiny_hf_config(tmp_path, gsm8k_dir):
    """`grpolab tiny-model` then configs/gsm8k_tiny_hf.yaml, 3 steps: on the shared GSM8K files when
    they are beside the repository, else on GSM8K-format files written here."""
    from conftest import GSM8K_DIR
    from transformers import AutoModelForCausalLM, AutoTokenizer
    data = GSM8K_DIR if (GSM8K_DIR / "train.jsonl").exists() else gsm8k_dir
    model_dir = tmp_path / "tiny"
    r = run_cli("tiny-model", str(model_dir), "--data", str(data / "test.jsonl"), "--vocab-size", "400")
    assert r.returncode == 0, r.stderr
    assert str(model_dir) in r.stdout
    hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(hf_tok) >= 400 and AutoModelForCausalLM.from_pretrained(str(model_dir)).config.vocab_size == len(hf_tok)
    # the BPE tokenizer was trained on the data: its questions take far fewer tokens than bytes
    question = json.loads((data / "test.jsonl").read_text().splitlines()[0])["question"]
    assert len(hf_tok(question)["input_ids"]) < 0.6 * len(question.encode())
    out = tmp_path / "run"
    r = run_cli("train", "configs/gsm8k_tiny_hf.yaml", f"model.name_or_path={model_dir}",
                f"data.train_path={data / 'train.jsonl'}", f"data.test_path={data / 'test.jsonl'}",
                "train.max_steps=3", f"train.output_dir={out}", "eval.num_problems=4")
    assert r.returncode == 0, r.stderr
    ckpts = sorted((out / "checkpoints").iterdir())
    assert ckpts[-1].name == "step_3"
    AutoModelForCausalLM.from_pretrained(str(ckpts[-1]))
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow
def test_hf_resume_with_a_reference_model(tiny_dir, tmp_path):
    """Tied embeddings in the reference checkpoint; a resumed HF run continues to the same metrics."""
    _gsm8k_file(tmp_path / "train.jsonl", arithmetic.generate("train", 40, seed=1))
    _gsm8k_file(tmp_path / "test.jsonl", arithmetic.generate("test", 6, seed=1))
    common = [f"model.name_or_path={tiny_dir}", "data.task=gsm8k", f"data.train_path={tmp_path}",
              "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=8",
              "reward.functions=[format]", "algorithm.beta=0.04", "eval.num_problems=2", "eval.k=2",
              "train.save_every=1"]
    r = run_cli("train", *common, "train.max_steps=3", f"train.output_dir={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr
    r = run_cli("train", *common, "train.max_steps=2", f"train.output_dir={tmp_path / 'b'}")
    assert r.returncode == 0, r.stderr
    r = run_cli("train", *common, "train.max_steps=3", f"train.output_dir={tmp_path / 'b'}", "train.resume=auto")
    assert r.returncode == 0, r.stderr
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
                       for x in open(p)]
    assert strip(tmp_path / "a" / "metrics.jsonl") == strip(tmp_path / "b" / "metrics.jsonl")
