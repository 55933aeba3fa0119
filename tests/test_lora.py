"""LoRA (model.lora_rank): adapters only are trained, the reference is the model with them off,
checkpoints are peft's adapter layout (HF) and resume exactly."""

import copy
import json

import pytest
import torch
from conftest import GSM8K_DIR, ROOT, run_cli
from test_grpo import make_trainer

from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.hf import load_hf
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.lora import adapters_off, add_lora, block_linear_names, has_lora
from grpolab.models.tiny_hf import save_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama") / "m", vocab_size=300, hidden=32, layers=2, heads=2,
                           intermediate=64)


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=CharTokenizer().vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=64))


def _lp(model):
    g = torch.Generator().manual_seed(3)
    pid, cid = torch.randint(0, 90, (3, 6), generator=g), torch.randint(0, 90, (3, 9), generator=g)
    with torch.no_grad():
        return completion_logprobs(model.eval(), pid, torch.ones_like(pid, dtype=torch.bool), cid,
                                   torch.ones_like(cid, dtype=torch.bool))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_reference_is_the_base_model_exactly(llama_dir, name):
    """With the adapters off, the LoRA policy's log-probs are a frozen copy of the base model's, bit
    for bit; with them on (non-zero B, as after training) they differ."""
    policy = _gpt() if name == "gpt" else load_hf(str(llama_dir))[0]
    base = copy.deepcopy(policy)
    add_lora(policy, {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": block_linear_names(policy)})
    with torch.no_grad():   # as if trained: B is zero at the start, which would make the test vacuous
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    with adapters_off(policy):
        off = _lp(policy)
    assert torch.equal(off, _lp(base))
    assert (_lp(policy) - off).abs().max() > 1e-3
    # every block linear is adapted (GPT: qkv, proj, fc, fc_out, incl. the two used as residual matmuls)
    targets = {"gpt": ["fc", "fc_out", "proj", "qkv"],
               "llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}[name]
    assert block_linear_names(base) == targets
    trainable = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == set(targets)


def test_only_adapters_train_and_hold_optimizer_state(tmp_path):
    tr = make_trainer(tmp_path, "train.max_steps=2", "algorithm.beta=0.04", "model.lora_rank=4",
                      "reward.functions=[length]")
    assert tr.lora and tr.ref is None   # no second copy of the model
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    hist = tr.train()
    after = tr.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert changed == {k for k in before if ".lora_" in k}   # every adapter moved (A and B)
    named = {id(p): n for n, p in tr.model.named_parameters()}
    assert {named[id(p)] for g in tr.opt.param_groups for p in g["params"]} == \
        {n for n, _ in tr.model.named_parameters() if ".lora_" in n}
    assert hist[-1]["kl"] > 0   # the adapters moved the policy away from the base reference


def _gsm8k_lora_args(data, model_dir, out):
    return [f"model.name_or_path={model_dir}", f"data.train_path={data / 'train.jsonl'}",
            f"data.test_path={data / 'test.jsonl'}", "model.lora_rank=8", "optim.lr=1e-2", "train.save_every=1",
            "reward.functions=[length,format]", "eval.num_problems=4", f"train.output_dir={out}"]


def _train_in_process(*overrides):
    """`grpolab train configs/gsm8k_tiny_hf.yaml OVERRIDES` in this process (as the CLI builds it)."""
    from grpolab.config.load import load_config
    from grpolab.jobs.common import setup_torch
    from grpolab.jobs.train import build_trainer
    from grpolab.monitor.console import Console
    from grpolab.train.run import Run
    cfg = load_config(str(ROOT / "configs" / "gsm8k_tiny_hf.yaml"), list(overrides))
    setup_torch(cfg)
    build_trainer(cfg, Run(cfg, "grpo"), Console(quiet=True)).train()


@pytest.mark.slow
def test_lora_run_of_the_gsm8k_tiny_hf_config_resumes_exactly(tmp_path, llama_dir, gsm8k_dir):
    """configs/gsm8k_tiny_hf.yaml with LoRA, 3 steps, against the same run stopped after step 2 and
    resumed: the same metrics. The checkpoint is peft's adapter layout; PeftModel loads it on
    the base model with the same logits; `grpolab eval` and model.init_from read it."""
    data = GSM8K_DIR if (GSM8K_DIR / "train.jsonl").exists() else gsm8k_dir
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    r = run_cli("train", "configs/gsm8k_tiny_hf.yaml", *_gsm8k_lora_args(data, llama_dir, whole), "train.max_steps=3")
    assert r.returncode == 0, r.stderr[-3000:]
    for steps in (2, 3):
        _train_in_process(*_gsm8k_lora_args(data, llama_dir, parts), f"train.max_steps={steps}", "train.resume=auto")
    # (eval/* and watch/*: the CLI logs its final eval with the last step; train() in process runs none)
    skip = ("time/", "perf/", "eval/", "watch/")
    strip = lambda d: [{k: v for k, v in json.loads(x).items() if not k.startswith(skip)}
                       for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert strip(parts) == strip(whole) and len(strip(whole)) == 3
    assert strip(whole)[-1]["kl"] > 0

    ckpt = whole / "checkpoints" / "step_3"
    assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "ref.safetensors").exists()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(llama_dir)), str(ckpt)).eval()
    from grpolab.models.checkpoint import load_model
    ours, _ = load_model(str(ckpt))
    assert has_lora(ours)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        mine = ours.eval()(ids)
        base = AutoModelForCausalLM.from_pretrained(str(llama_dir))(input_ids=ids).logits
    assert (theirs - mine).abs().max() <= 1e-5 and (theirs - base).abs().max() > 1e-4

    r = run_cli("eval", str(ckpt), "eval.num_problems=2", "eval.k=2", f"data.train_path={data / 'train.jsonl'}",
                f"data.test_path={data / 'test.jsonl'}", "data.task=gsm8k")
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"greedy_accuracy", "pass@1", "pass@2"} <= set(json.loads((ckpt / "eval.json").read_text()))
    more = tmp_path / "more"
    _train_in_process(*_gsm8k_lora_args(data, llama_dir, more), f"model.init_from={ckpt}", "train.max_steps=1")
    assert (more / "checkpoints" / "step_1" / "adapter_config.json").is_file()   # went on training the adapters


def test_lora_config_errors():
    from grpolab.config.load import load_config
    from grpolab.errors import ConfigError
    for override, msg in [("model.lora_rank=-1", "model.lora_rank: must be >= 0"),
                          ("model.lora_dropout=1.0", "model.lora_dropout: must be in [0, 1)"),
                          ("train.strategy=fsdp", "train.strategy: fsdp with model.lora_rank > 0 is not supported"),
                          ("algorithm.ref_sync_steps=2", "algorithm.ref_sync_steps: with model.lora_rank > 0")]:
        extra = [] if override.startswith("model.lora") else ["model.lora_rank=4", "algorithm.beta=0.04"]
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            load_config(None, [override, *extra])
