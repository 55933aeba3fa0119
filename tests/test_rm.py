"""Reward-model training (`grpolab rm`): the Bradley-Terry loss against a plain computation; a tiny
built-in reward model that learns a held-out preference, whose checkpoint `rm:<dir>` scores as a
plain forward does; exact resume; LoRA on a Hugging Face backbone, saved as a plain sequence
classifier; one-line errors for bad pairs."""

import json
import math
import random

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

from grpolab.algorithms.losses import bradley_terry_loss
from grpolab.cli import main
from grpolab.config.load import load_config
from grpolab.errors import RewardError
from grpolab.rewards import get_reward

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=64", "log.level=quiet",
        "rm.batch_size=16", "rm.lr=3e-3", "rm.warmup_steps=2", "rm.eval_size=16"]


def test_bradley_terry_loss_matches_a_plain_computation():
    torch.manual_seed(0)
    c, r, m = torch.randn(7) * 3, torch.randn(7) * 3, torch.rand(7)
    for margin in (0.0, 0.5, m):
        for coef in (0.0, 0.01):
            got = bradley_terry_loss(c, r, margin, coef)
            for i in range(7):
                mi = float(margin[i]) if torch.is_tensor(margin) else margin
                d = float(c[i]) - float(r[i]) - mi
                want = math.log(1 + math.exp(-d)) + coef * (float(c[i]) + float(r[i])) ** 2
                assert float(got[i]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the loss prefers the chosen side: its gradient raises r_chosen and lowers r_rejected
    c.requires_grad_(True)
    r.requires_grad_(True)
    bradley_terry_loss(c, r).sum().backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()


def _pairs(n: int, seed: int) -> list[dict]:
    """Chosen completions say 'good', rejected ones 'bad', after the same random letters."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tail = "".join(rng.choice("xyzw ") for _ in range(rng.randint(3, 9)))
        out.append({"prompt": f"rate item {rng.randint(0, 99)}", "chosen": f"{tail} good", "rejected": f"{tail} bad"})
    return out


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _lines(run_dir) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith(("time/", "perf/"))}
            for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def builtin_rm(tmp_path_factory):
    from grpolab.jobs.rm import run_rm
    d = tmp_path_factory.mktemp("rm")
    pairs = _write(d / "pairs.jsonl", _pairs(80, 0))
    out = d / "run"
    summary = run_rm(load_config(None, [*TINY, f"rm.pairs={pairs}", "rm.steps=30", f"train.output_dir={out}",
                                        "train.save_every=15", "train.keep_checkpoints=0"]))
    return out, pairs, summary


def test_builtin_reward_model_learns_the_heldout_preference_and_rm_scores_like_a_plain_forward(builtin_rm):
    out, _, summary = builtin_rm
    assert summary["before"] == {}   # a fresh model is not evaluated
    assert summary["after"]["accuracy"] >= 0.9 and summary["after"]["margin"] > 0.5
    rows = _lines(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"accuracy", "margin", "rewards/chosen", "rewards/rejected", "loss"} <= rows[0].keys()

    ckpt = out / "checkpoints" / "step_30"
    fn = get_reward(f"rm:{ckpt}")
    fresh = _pairs(12, 99)   # pairs no step saw
    chosen = fn([p["prompt"] for p in fresh], [p["chosen"] for p in fresh])
    rejected = fn([p["prompt"] for p in fresh], [p["rejected"] for p in fresh])
    assert sum(c > r for c, r in zip(chosen, rejected)) >= 11

    # the score, recomputed plainly: the GPT's normed hidden state at <|end|>, times the head's weights
    from grpolab.models import GPT, CharTokenizer, GPTConfig
    meta = json.loads((ckpt / "model_config.json").read_text())
    assert meta.pop("type") == "builtin-rm"
    sd = load_file(str(ckpt / "model.safetensors"))
    gpt = GPT(GPTConfig(**meta))
    gpt.load_state_dict({k.removeprefix("backbone."): v for k, v in sd.items() if k.startswith("backbone.")})
    tok = CharTokenizer()
    for p, got in zip(fresh[:4], chosen[:4]):
        ids = tok.render_prompt(p["prompt"]) + tok.encode(p["chosen"]) + [tok.eos_id]
        with torch.no_grad():
            h = gpt.eval()(torch.tensor([ids]), hidden=True)[0, -1]
        assert got == pytest.approx(float(h @ sd["score.weight"][0]), abs=1e-5)


def test_reward_model_resume_matches_the_uninterrupted_run(builtin_rm, tmp_path):
    from grpolab.jobs.rm import run_rm
    out, pairs, _ = builtin_rm
    run_rm(load_config(None, [*TINY, f"rm.pairs={pairs}", "rm.steps=30", f"train.output_dir={tmp_path}",
                              f"train.resume={out / 'checkpoints' / 'step_15'}"]))
    assert _lines(tmp_path) == _lines(out)[15:]
    a, b = (load_file(str(d / "checkpoints" / "step_30" / "model.safetensors")) for d in (out, tmp_path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rm_of_a_policy_checkpoint_is_refused_in_one_line(tmp_path):
    from grpolab.models import GPT, CharTokenizer, GPTConfig
    from grpolab.models.checkpoint import save_checkpoint
    tok = CharTokenizer()
    ckpt = save_checkpoint(tmp_path, 0, GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32,
                                                      block_size=32)), tokenizer=tok)
    with pytest.raises(RewardError, match=r"is a policy checkpoint \(builtin-gpt\), not a reward model; train one "
                                          r"with `grpolab rm`"):
        get_reward(f"rm:{ckpt}")


def test_hf_lora_reward_model_saves_a_plain_classifier_and_resumes_exactly(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from grpolab.jobs.rm import run_rm
    from grpolab.models.tiny_hf import save_tiny_model
    pairs = _pairs(64, 1)
    base = save_tiny_model(tmp_path / "llama", [p["prompt"] + p["chosen"] + p["rejected"] for p in pairs],
                           vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    with pytest.raises(RewardError, match=r"is a policy checkpoint \(LlamaForCausalLM\), not a reward model"):
        get_reward(f"rm:{base}")   # a causal LM's new head would score at random
    path = _write(tmp_path / "pairs.jsonl", pairs)
    over = [*TINY, f"model.name_or_path={base}", "model.lora_rank=8", "model.lora_alpha=16", f"rm.pairs={path}",
            "rm.steps=16", "rm.lr=1e-2", "train.keep_checkpoints=0"]
    first = run_rm(load_config(None, [*over, f"train.output_dir={tmp_path / 'a'}", "train.save_every=8"]))
    assert first["after"]["accuracy"] >= 0.9 > first["before"]["accuracy"]
    ckpt = tmp_path / "a" / "checkpoints" / "step_16"
    assert not (ckpt / "adapter_config.json").exists() and (ckpt / "adapter" / "adapter_config.json").is_file()

    # `rm:<dir>` reads it as a plain sequence classifier: the same scores as transformers' own loader
    plain = AutoModelForSequenceClassification.from_pretrained(ckpt).eval()
    fn = get_reward(f"rm:{ckpt}")
    tok = fn.tokenizer
    texts = [p["prompt"] + p["chosen"] for p in pairs[:4]]
    with torch.no_grad():
        want = [float(plain(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]
    assert fn([p["prompt"] for p in pairs[:4]], [p["chosen"] for p in pairs[:4]]) == pytest.approx(want, abs=1e-4)

    run_rm(load_config(None, [*over, f"train.output_dir={tmp_path / 'b'}",
                              f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_8'}"]))
    assert _lines(tmp_path / "b") == _lines(tmp_path / "a")[8:]


@pytest.mark.parametrize("bad, msg", [
    ({"prompt": "q", "chosen": "", "rejected": "no"}, r"row 2: 'chosen' is empty"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, r"row 2: chosen and rejected are the same"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}, r"row 2: 'margin' is 'big'"),
])
def test_bad_pairs_stop_rm_with_one_line_naming_the_row(tmp_path, capsys, bad, msg):
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, bad])
    assert main(["rm", f"rm.pairs={path}", f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("grpolab: data error:")
    import re
    assert re.search(msg, err), err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_missing_starting_model_is_one_line(tmp_path, capsys):
    path = _write(tmp_path / "pairs.jsonl", _pairs(8, 0))
    assert main(["rm", f"rm.pairs={path}", "rm.eval_size=2", "model.init_from=./no/such/sft",
                 f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "grpolab: config error: model.init_from: './no/such/sft' is not a directory; give a checkpoint, " \
                  "a Hugging Face model directory or a hub id"


def test_builtin_lora_reward_model_trains_adapters_and_head_only(tmp_path):
    from grpolab.jobs.rm import run_rm
    from grpolab.models import GPT, CharTokenizer, GPTConfig
    from grpolab.models.checkpoint import save_checkpoint
    tok = CharTokenizer()
    torch.manual_seed(0)
    policy = save_checkpoint(tmp_path / "policy", 0, GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2,
                                                                   n_embd=32, block_size=64)), tokenizer=tok)
    pairs = _write(tmp_path / "pairs.jsonl", _pairs(40, 3))
    run_rm(load_config(None, [*TINY, f"rm.pairs={pairs}", "rm.steps=4", f"model.init_from={policy}",
                              "model.lora_rank=4", f"train.output_dir={tmp_path / 'run'}"]))
    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    assert json.loads((ckpt / "model_config.json").read_text())["lora"]["r"] == 4
    before, after = load_file(str(policy / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    base = {k: v for k, v in after.items() if "lora_" not in k and k.startswith("backbone.")}
    assert base and all(torch.equal(v, before[k.removeprefix("backbone.").replace(".base_layer", "")])
                        for k, v in base.items())   # the backbone's own weights did not move
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in after.items())   # the adapters did
    fn = get_reward(f"rm:{ckpt}")   # loads with its adapters on
    p = _pairs(3, 5)
    scores = fn([x["prompt"] for x in p], [x["chosen"] for x in p])
    assert len(set(scores)) == 3


def test_a_dpo_checkpoint_scores_as_its_implicit_reward(tmp_path):
    """rm:<dpo checkpoint> = dpo.beta * (log pi(y|x) - log pi_ref(y|x)) over the completion and its stop
    token, recomputed here from the two models' logits."""
    from safetensors.torch import load_model as load_weights

    from grpolab.jobs.dpo import run_dpo
    from grpolab.models import CharTokenizer
    from grpolab.models.checkpoint import load_model
    pairs = _write(tmp_path / "pairs.jsonl", _pairs(32, 4))
    run_dpo(load_config(None, [*TINY, f"dpo.pairs={pairs}", "dpo.steps=4", "dpo.batch_size=8", "dpo.lr=3e-3",
                               "dpo.beta=0.2", "data.train_size=20", "data.test_size=4", "eval.num_problems=4",
                               "model.block_size=128", "eval.k=2",
                               f"train.output_dir={tmp_path / 'dpo'}"]))
    ckpt = tmp_path / "dpo" / "checkpoints" / "step_4"
    fn = get_reward(f"rm:{ckpt}")
    fresh = _pairs(3, 7)
    got = fn([p["prompt"] for p in fresh], [p["chosen"] for p in fresh])
    policy, _ = load_model(ckpt)
    ref, _ = load_model(ckpt)
    load_weights(ref, str(ckpt / "ref.safetensors"))
    tok = CharTokenizer()

    def logp(model, prompt, completion):
        p, c = tok.render_prompt(prompt), tok.encode(completion) + [tok.eos_id]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            lp = torch.log_softmax(model.eval()(ids)[0, :-1].float(), -1)
        return sum(float(lp[len(p) - 1 + i, t]) for i, t in enumerate(c))
    want = [0.2 * (logp(policy, p["prompt"], p["chosen"]) - logp(ref, p["prompt"], p["chosen"])) for p in fresh]
    assert got == pytest.approx(want, abs=1e-4)
    assert max(abs(w) for w in want) > 1e-3   # the policy moved off its reference


# a local path that is missing is said at once, with no hub call (offline, the hub's retries took 51 s)
CLI_TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=96", "sft.steps=2",
            "sft.bare_steps=0", "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8",
            "train.max_steps=2", "eval.num_problems=4", "eval.k=2", "train.threads=1"]


@pytest.mark.slow
@pytest.mark.parametrize("spec, what", [
    ("runs/nothere", ""),           # runs/ is a directory here: a local path
    ("my model/rm", ""),            # not a hub id (a space)
    ("a/b/c", ""),                  # not a hub id (two slashes)
    ("runs/a_file", " (it is a file)"),
])
def test_a_missing_local_reward_model_is_one_line_at_once(tmp_path, spec, what):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a_file").write_text("not a model")
    r = run_cli("train", *CLI_TINY, "train.output_dir=out", f"reward.functions=[rm:{spec}]", cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert lines == [f"grpolab: reward error: reward 'rm:{spec}': directory '{spec}' not found{what}; give a local "
                     f"model directory (relative to {tmp_path}) or a hub id"], r.stderr
