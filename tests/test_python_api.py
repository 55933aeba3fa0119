"""grpolab from Python: TRL's GRPO quick start with only the import changed, the same run as `grpolab train`, and
every TRL field grpolab does not implement refused with one line (grpolab/api/, docs/python-api.md)."""

import json
import re
import subprocess
import sys

import pytest
import torch
from api_rewards import reward_len
from conftest import ROOT, run_cli
from safetensors.torch import load_file

import grpolab
from grpolab.api.grpo_fields import grpo_settings
from grpolab.data.tasks import arithmetic
from grpolab.errors import ConfigError
from grpolab.models.tiny_hf import save_tiny_model

sys.path.insert(0, str(ROOT / "scripts"))
import fetch_smollm2  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    rows = arithmetic.generate("train", 200, seed=0)
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", [r["prompt"] + "\n" + r["answer"] for r in rows],
                           vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)


def _prompts(n: int) -> list[dict]:
    return [{"prompt": r["prompt"]} for r in arithmetic.generate("train", n, seed=3)]


def _metrics(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(path)]


def _assert_same_run(a, b, steps: int) -> None:
    """Two run directories with the same metrics.jsonl (timings aside) and the same weights at the last step."""
    ma, mb = _metrics(a / "metrics.jsonl"), _metrics(b / "metrics.jsonl")
    assert len(ma) == steps and ma == mb
    wa = load_file(str(a / "checkpoints" / f"step_{steps}" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / f"step_{steps}" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_importing_grpolab_loads_no_torch_until_the_api_is_used():
    probe = ("import sys, grpolab; a = 'torch' in sys.modules; from grpolab import GRPOConfig; "
             "print(a, 'torch' in sys.modules, GRPOConfig is grpolab.api.GRPOConfig)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "True", "True"], r.stderr
    with pytest.raises(AttributeError):
        grpolab.NoSuchTrainer


def _quick_start(model, out, tiny_model: bool):
    """TRL's documented GRPO quick start (a reward_len function, a dataset of prompts, GRPOConfig with a few
    fields, LoRA through peft's LoraConfig), with `from trl import` made `from grpolab import`."""
    from datasets import Dataset
    from peft import LoraConfig

    from grpolab import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list(_prompts(24))

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    training_args = GRPOConfig(output_dir=str(out), learning_rate=1e-4 if tiny_model else 1e-5, logging_steps=1,
                               per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
                               max_steps=2)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=training_args, train_dataset=dataset,
                          peft_config=peft_config)
    trainer.train()
    return trainer


def _check_quick_start(trainer, base, out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = trainer.state.log_history
    assert [r["step"] for r in rows] == [1, 2] and trainer.state.global_step == 2
    # the logged reward is reward_len over the completions the step sampled (samples.jsonl holds all 4 of step 1)
    samples = [json.loads(line) for line in open(out / "samples.jsonl") if json.loads(line)["step"] == 1]
    assert len(samples) == 4
    want = sum(-abs(20 - len(s["completion"])) for s in samples) / 4
    assert rows[0]["rewards/reward_len/mean"] == pytest.approx(want)
    saved = trainer.save_model(str(out / "saved"))
    assert not (out / "saved" / "optimizer.pt").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(base))
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), saved)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert not torch.equal(plain(ids).logits, tuned(ids).logits)   # the trained adapter loaded and changes it


@pytest.mark.slow
def test_trl_quick_start_runs_with_only_the_import_changed_on_a_tiny_llama(tiny, tmp_path):
    trainer = _quick_start(str(tiny), tmp_path / "run", tiny_model=True)
    _check_quick_start(trainer, tiny, tmp_path / "run")


@pytest.mark.slow
def test_trl_quick_start_runs_on_smollm2(tmp_path):
    model = fetch_smollm2.fetch(fetch_smollm2.DEFAULT_OUT)
    trainer = _quick_start(str(model), tmp_path / "run", tiny_model=False)
    _check_quick_start(trainer, model, tmp_path / "run")


@pytest.mark.slow
def test_the_trainer_and_grpolab_train_give_the_same_bits(tiny, tmp_path):
    """GRPOTrainer with a GRPOConfig, and `grpolab train` with the YAML a user would write for it by hand."""
    from grpolab import GRPOConfig, GRPOTrainer

    rows = _prompts(16)
    api = tmp_path / "api"
    GRPOTrainer(model=str(tiny), reward_funcs=[reward_len], train_dataset=rows,
                args=GRPOConfig(output_dir=str(api), learning_rate=1e-3, per_device_train_batch_size=4,
                                gradient_accumulation_steps=2, num_generations=4, max_completion_length=10,
                                num_train_epochs=1, beta=0.04, loss_type="grpo", seed=5, warmup_ratio=0.25,
                                **{"train.threads": 1})).train()
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = tmp_path / "cli"
    (tmp_path / "run.yaml").write_text(f"""
model: {{name_or_path: {tiny}}}
data: {{task: files, train_path: {tmp_path / 'train.jsonl'}, answer_key: null, train_size: 0}}
reward: {{functions: ["{ROOT / 'tests' / 'api_rewards.py'}:reward_len"]}}
rollout: {{prompts_per_step: 2, num_generations: 4, max_new_tokens: 10}}
algorithm: {{beta: 0.04, loss_agg_mode: seq-mean-token-mean, unbiased_std: true}}
optim: {{lr: 1.0e-3, beta2: 0.999, lr_schedule: linear, warmup_steps: 2, micro_batch_size: 4}}
train: {{max_steps: 8, seed: 5, output_dir: {cli}, log_every: 10, save_every: 500, keep_checkpoints: 0, threads: 1}}
eval: {{num_problems: 0}}
""")
    r = run_cli("train", str(tmp_path / "run.yaml"))
    assert r.returncode == 0, r.stderr
    _assert_same_run(api, cli, 8)


def _docs_tables() -> dict[str, dict[str, str]]:
    """docs/python-api.md's field tables by section: {section: {TRL field: its grpolab column}}."""
    out: dict[str, dict[str, str]] = {}
    section = None
    for line in (ROOT / "docs" / "python-api.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"\| `(\w+)` \| (.+?) \|", line)
        if m and section in ("Shared fields", "GRPOConfig", "SFTConfig", "DPOConfig", "RewardConfig"):
            out.setdefault(section, {})[m.group(1)] = m.group(2)
    return out


@pytest.mark.parametrize("name", ["GRPOConfig", "SFTConfig", "DPOConfig", "RewardConfig"])
def test_the_docs_tables_list_every_field_and_every_unsupported_one_is_refused(name):
    config = getattr(grpolab, name)
    tables = _docs_tables()
    table = {**tables["Shared fields"], **tables[name]}   # a trainer's own row overrides the shared one
    assert set(table) == set(config.FIELDS) | set(config.UNSUPPORTED)
    for field, (default, other, _) in config.UNSUPPORTED.items():
        assert table[field].startswith("not supported"), field
        config(**{field: default})   # TRL's default: accepted
        with pytest.raises(ConfigError, match=rf"^{name}\.{field}=.*not supported by grpolab"):
            config(**{field: other})
    for field in config.FIELDS:
        assert not table[field].startswith("not supported"), field
        assert getattr(config(), field) == config.FIELDS[field]   # TRL's default, readable as TRL's attribute
    with pytest.raises(ConfigError, match="unknown field 'lerning_rate'"):
        config(lerning_rate=1e-5)


def test_trl_fields_map_onto_grpolab_keys():
    s = grpo_settings({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4,
                       "num_train_epochs": 2, "warmup_ratio": 0.1, "loss_type": "dr_grpo", "scale_rewards": False,
                       "importance_sampling_level": "sequence", "top_k": None}, train_rows=10, eval_rows=0)
    assert s["rollout.prompts_per_step"] == 4 and s["optim.micro_batch_size"] == 8
    assert s["train.max_steps"] == 2 * 3          # 2 epochs of ceil(10 / 4) steps
    assert s["optim.warmup_steps"] == 1           # ceil(0.1 * 6)
    assert s["algorithm.loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert s["algorithm.scale_rewards"] == "none" and s["algorithm.policy_loss"] == "gspo"
    assert s["rollout.top_k"] == 0 and s["optim.lr"] == 1e-6 and s["train.seed"] == 42   # TRL's defaults
    with pytest.raises(ConfigError, match="divisible by num_generations"):
        grpo_settings({"per_device_train_batch_size": 6, "num_generations": 4}, 10, 0)
    v = grpo_settings({"use_vllm": True}, 10, 0)   # TRL's default correction: sequence-level masking at 3.0
    assert (v["rollout.source"], v["algorithm.rollout_correction"], v["algorithm.rollout_correction_level"],
            v["algorithm.rollout_correction_threshold"]) == ("vllm", "mis", "sequence", 3.0)
    with pytest.raises(ConfigError, match="vllm_mode='colocate'"):
        grpo_settings({"use_vllm": True, "vllm_mode": "server"}, 10, 0)


def test_bad_inputs_are_one_clear_error(tiny, tmp_path):
    from peft import LoraConfig

    from grpolab import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="train_dataset is required"):
        GRPOTrainer(model=str(tiny), reward_funcs=reward_len, args=args)
    with pytest.raises(ConfigError, match="train_dataset: give a datasets.Dataset"):
        GRPOTrainer(model=str(tiny), reward_funcs=reward_len, args=args, train_dataset=42)
    with pytest.raises(ConfigError, match="peft_config.use_dora=True: not supported"):
        GRPOTrainer(model=str(tiny), reward_funcs=reward_len, args=args, train_dataset=_prompts(4),
                    peft_config=LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    with pytest.raises(ConfigError, match="reward_funcs: 3 is neither"):
        GRPOTrainer(model=str(tiny), reward_funcs=[3], args=args, train_dataset=_prompts(4))
    with pytest.raises(ConfigError, match="processing_class: grpolab reads the tokenizer from the model's directory"):
        GRPOTrainer(model=str(tiny), reward_funcs=reward_len, args=args, train_dataset=_prompts(4),
                    processing_class=object()).train()
    with pytest.raises(ConfigError, match="args: GRPOTrainer takes a GRPOConfig, not a SFTConfig"):
        GRPOTrainer(model=str(tiny), reward_funcs=reward_len, args=grpolab.SFTConfig(), train_dataset=_prompts(4))


def _conversations(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
            for r in arithmetic.generate("train", n, seed=4)]


def _pairs(n: int) -> list[dict]:
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"].rsplit("#### ", 1)[0] + "#### 999"}
            for r in arithmetic.generate("train", n, seed=5)]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_trl_sft_dpo_and_reward_quick_starts_run_with_only_the_import_changed(which, tiny, tmp_path, monkeypatch):
    """TRL's quick starts for SFTTrainer, DPOTrainer and RewardTrainer (model and train_dataset only, TRL's
    defaults: 3 epochs of 8 rows, output in <model name>-SFT and so on)."""
    from datasets import Dataset

    from grpolab import DPOTrainer, RewardTrainer, SFTTrainer

    model = str(tiny if which == "tiny" else fetch_smollm2.fetch(fetch_smollm2.DEFAULT_OUT))
    name = model.rstrip("/").split("/")[-1]
    monkeypatch.chdir(tmp_path)
    rows = 16 if which == "tiny" else 8
    sft = SFTTrainer(model=model, train_dataset=Dataset.from_list(_conversations(rows)))
    sft.train()
    steps = 3 * rows // 8   # 3 epochs of rows / 8
    assert sft.state.global_step == steps and len(sft.state.log_history) == steps
    assert (tmp_path / f"{name}-SFT" / "checkpoints" / f"step_{steps}").is_dir()
    dpo = DPOTrainer(model=model, train_dataset=Dataset.from_list(_pairs(8)))
    dpo.train()
    assert dpo.state.global_step == 3 and (tmp_path / f"{name}-DPO" / "metrics.jsonl").is_file()
    if which == "smollm2":   # (the reward model and the saved copies on the tiny model only: 540 MB each)
        return
    rm = RewardTrainer(model=model, train_dataset=Dataset.from_list(_pairs(8)))
    rm.train()
    assert rm.state.global_step == 3
    assert {"loss", "accuracy", "margin"} <= set(rm.state.log_history[0])
    # what save_model writes loads with plain transformers: a causal LM, and a sequence classifier for the reward model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    AutoModelForCausalLM.from_pretrained(sft.save_model(str(tmp_path / "sft_model")))
    AutoModelForCausalLM.from_pretrained(dpo.save_model(str(tmp_path / "dpo_model")))
    scorer = AutoModelForSequenceClassification.from_pretrained(rm.save_model(str(tmp_path / "rm_model")))
    assert scorer.config.num_labels == 1


@pytest.mark.slow
def test_the_sft_trainer_and_grpolab_sft_give_the_same_bits(tiny, tmp_path):
    from grpolab import SFTConfig, SFTTrainer

    rows = _conversations(12)
    api = tmp_path / "api"
    SFTTrainer(model=str(tiny), train_dataset=rows,
               args=SFTConfig(output_dir=str(api), learning_rate=1e-3, per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, num_train_epochs=2, seed=3, max_length=64,
                              lr_scheduler_type="cosine", **{"train.threads": 1})).train()
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = tmp_path / "cli"
    (tmp_path / "sft.yaml").write_text(f"""
model: {{name_or_path: {tiny}}}
data: {{task: files, train_path: {tmp_path / 'train.jsonl'}, train_size: 0}}
sft: {{train_path: {tmp_path / 'train.jsonl'}, steps: 6, batch_size: 4, micro_batch_size: 2, lr: 1.0e-3,
       beta2: 0.999, lr_schedule: cosine, warmup_steps: 0, max_length: 64}}
train: {{seed: 3, output_dir: {cli}, log_every: 10, save_every: 500, keep_checkpoints: 0, threads: 1}}
""")
    r = run_cli("sft", str(tmp_path / "sft.yaml"))
    assert r.returncode == 0, r.stderr
    _assert_same_run(api, cli, 6)


@pytest.mark.slow
def test_a_callback_sees_every_step_and_stops_the_run_which_then_resumes_to_the_uninterrupted_bits(tiny, tmp_path):
    """A transformers TrainerCallback (the real class) on GRPOTrainer: on_log gets each step's metrics, setting
    control.should_training_stop after step 2 ends the run with a checkpoint, and train(resume_from_checkpoint=True)
    finishes it with the metrics and weights of a run never stopped."""
    from transformers import TrainerCallback

    from grpolab import GRPOConfig, GRPOTrainer

    class Stopper(TrainerCallback):
        def __init__(self):
            self.events, self.logs = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append(("begin", state.global_step, state.max_steps, args.max_steps))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(logs)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):
            self.events.append(("save", state.global_step))

    def args(out):
        return GRPOConfig(output_dir=str(out), learning_rate=1e-3, per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=8, max_steps=4, beta=0.04, **{"train.threads": 1})

    rows, stopper = _prompts(12), Stopper()
    stopped = GRPOTrainer(model=str(tiny), reward_funcs=reward_len, train_dataset=rows, args=args(tmp_path / "a"),
                          callbacks=[stopper])
    stopped.train()
    assert stopped.state.global_step == 2
    assert stopper.events == [("begin", 0, 4, 4), ("save", 2)]
    assert [m["step"] for m in stopper.logs] == [1, 2]
    assert [json.loads(line)["reward"] for line in open(tmp_path / "a" / "metrics.jsonl")] == \
        [m["reward"] for m in stopper.logs]
    resumed = GRPOTrainer(model=str(tiny), reward_funcs=reward_len, train_dataset=rows, args=args(tmp_path / "a"))
    resumed.train(resume_from_checkpoint=True)
    GRPOTrainer(model=str(tiny), reward_funcs=reward_len, train_dataset=rows, args=args(tmp_path / "b")).train()
    assert resumed.state.global_step == 4
    _assert_same_run(tmp_path / "a", tmp_path / "b", 4)


@pytest.mark.slow
def test_evaluate_scores_the_last_checkpoint_as_the_final_eval_did(tiny, tmp_path):
    from grpolab import GRPOConfig, GRPOTrainer

    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic.generate("train", 12, seed=6)]
    held = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic.generate("test", 4, seed=6)]

    class Evals:   # any object with the methods it wants will do
        seen: list = []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.seen.append((state.global_step, metrics))

    trainer = GRPOTrainer(model=str(tiny), reward_funcs="gsm8k_accuracy", train_dataset=rows, eval_dataset=held,
                          callbacks=[Evals],
                          args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                          max_completion_length=8, max_steps=2, eval_strategy="steps", eval_steps=1,
                                          **{"eval.k": 2, "train.threads": 1}))
    final = trainer.train()
    assert set(final) == {"greedy_accuracy", "pass@1", "pass@2", "maj@2", "rewards/gsm8k_accuracy/mean"}
    assert trainer.evaluate() == {f"eval_{k}": v for k, v in final.items()}
    # the periodic eval after step 1 and the final one after step 2, as metrics.jsonl's rows hold them
    logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [step for step, _ in Evals.seen] == [1, 2]
    for (step, metrics), row in zip(Evals.seen, logged):
        assert metrics and all(row[k] == v for k, v in metrics.items())
    with pytest.raises(ConfigError, match="evaluate: not supported"):
        from grpolab import SFTTrainer
        SFTTrainer(model=str(tiny), train_dataset=_conversations(2)).evaluate()


@pytest.mark.slow
def test_a_loaded_model_and_a_grpolab_checkpoint_are_models_too(tiny, tmp_path):
    """SFT on a loaded transformers model (saved into the run with its tokenizer) runs as SFT on its directory does,
    bit for bit; GRPO from that SFT run's checkpoint starts from the SFT weights (model.init_from)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpolab import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    def sft_args(out):
        return SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                         **{"train.threads": 1})

    loaded = AutoModelForCausalLM.from_pretrained(str(tiny))
    SFTTrainer(model=loaded, processing_class=AutoTokenizer.from_pretrained(str(tiny)), train_dataset=_conversations(8),
               args=sft_args(tmp_path / "loaded")).train()
    SFTTrainer(model=str(tiny), train_dataset=_conversations(8), args=sft_args(tmp_path / "path")).train()
    _assert_same_run(tmp_path / "loaded", tmp_path / "path", 2)

    def grpo(model, out):
        t = GRPOTrainer(model=model, reward_funcs=reward_len, train_dataset=_prompts(4),
                        args=GRPOConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4,
                                        num_generations=4, max_completion_length=6, **{"train.threads": 1}))
        t.train()
        return t, [json.loads(line)["completion"] for line in open(out / "samples.jsonl")]

    ckpt = tmp_path / "path" / "checkpoints" / "step_2"
    from_sft, tuned = grpo(str(ckpt), tmp_path / "grpo_sft")
    assert from_sft.config.model.init_from == str(ckpt)
    _, base = grpo(str(tiny), tmp_path / "grpo_base")
    assert tuned != base   # the same seed samples other completions from the SFT weights
