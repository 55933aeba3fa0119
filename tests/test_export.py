"""`grpolab export`: standalone Hugging Face directories that load without grpolab and give the
checkpoint's logits."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import run_cli
from test_grpo import make_trainer

# run in a fresh interpreter that never imports grpolab: the export must stand alone
LOAD_ALONE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, prompt = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(out)
if len(sys.argv) > 3:   # the ids to score (a plain-text prompt of an HF model)
    ids = json.loads(sys.argv[3])
else:                  # the chat template's rendering
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
with torch.no_grad():
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
assert not any(m.startswith("grpolab") for m in sys.modules)
print(json.dumps({"ids": ids, "logits": logits.tolist(), "dtype": str(next(model.parameters()).dtype),
                  "type": model.config.model_type}))
"""


def _load_alone(out, prompt, tmp_path, ids=None):
    script = tmp_path / "load_alone.py"
    script.write_text(LOAD_ALONE)
    r = subprocess.run([sys.executable, str(script), str(out), prompt, *([json.dumps(ids)] if ids else [])],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ours(ckpt, prompt):
    from grpolab.models.checkpoint import load_model
    model, tok = load_model(str(ckpt))
    ids = tok.render_prompt(prompt)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids]))[0, -1]
    return ids, logits, tok


def _in_process(out, ids):
    """The export's last-position logits for `ids`, loaded with transformers in this process."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_builtin_gpt_exports_as_an_hf_model_with_the_same_logits(tmp_path, lora):
    """A trained built-in GPT (LoRA adapters merged in when it has them) becomes an Arcee-architecture
    HF model plus a character tokenizer with the same ids and chat format. The LoRA case goes
    through the CLI and is loaded by a Python that never imports grpolab."""
    from grpolab.jobs.export import run_export as export
    tr = make_trainer(tmp_path / "run", "train.max_steps=2", "reward.functions=[length]", "optim.lr=1e-2",
                      *(["model.lora_rank=4"] if lora else []))
    tr.train()
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    prompt = "Tom has 3 apples and gets 4 more. How many?"
    ids, logits, _ = _ours(ckpt, prompt)
    if lora:
        r = run_cli("export", str(ckpt), str(tmp_path / "hf"), "--merge")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "built-in GPT as an Arcee" in r.stdout
        got = _load_alone(tmp_path / "hf", prompt, tmp_path)
        assert got["ids"] == ids and got["type"] == "arcee"   # the chat template renders as we do
        got = torch.tensor(got["logits"])
    else:
        assert "built-in GPT as an Arcee" in export(ckpt, tmp_path / "hf")
        got = _in_process(tmp_path / "hf", ids)
    assert (got - logits).abs().max() <= 1e-5


def test_exports_of_hf_checkpoints(tmp_path):
    """A LoRA checkpoint of an HF model: --merge gives a standalone model with its logits; without,
    peft's adapter directory. A full checkpoint exports in bfloat16. A non-empty target is refused."""
    from grpolab.errors import ExportError
    from grpolab.jobs.export import run_export as export
    from grpolab.models.tiny_hf import save_tiny_model
    base = save_tiny_model(tmp_path / "base", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    for name, extra in (("lora", ["model.lora_rank=4"]), ("full", [])):
        tr = make_trainer(tmp_path / name, f"model.name_or_path={base}", "train.max_steps=1", "optim.lr=1e-2",
                          "reward.functions=[length]", *extra)
        tr.train()
    lora_ckpt, full_ckpt = (tmp_path / n / "checkpoints" / "step_1" for n in ("lora", "full"))
    ids, logits, _ = _ours(lora_ckpt, "What is 2 + 3?")
    assert "(LoRA merged)" in export(lora_ckpt, tmp_path / "merged", merge=True)
    assert (_in_process(tmp_path / "merged", ids) - logits).abs().max() <= 1e-5
    assert (logits - _ours(base, "What is 2 + 3?")[1]).abs().max() > 1e-4   # the adapters did change the model
    assert not (tmp_path / "merged" / "adapter_config.json").exists()

    assert "LoRA adapter (peft layout)" in export(lora_ckpt, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    export(full_ckpt, tmp_path / "bf16", dtype="bfloat16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert not (tmp_path / "bf16" / "optimizer.pt").exists()
    assert (_in_process(tmp_path / "bf16", ids) - _ours(full_ckpt, "What is 2 + 3?")[1]).abs().max() <= 5e-2

    with pytest.raises(ExportError, match="exists and is not empty"):
        export(full_ckpt, tmp_path / "bf16")
