"""SmolLM2 rollouts on the lean path, one setting at a time, alternating: how the decode attention and the
leaving of finished rows change a rollout's time, and attention's share of a profiled rollout.

Settings (comma-separated, each a set of words):
  * `full`: one attention call over every column (the decode before row_attention.py); else runs of rows
    each over its own columns;
  * `share`: a group's prompt keys and values kept once (lean_decode.SHARE_MIN_BYTES forced to 0); else
    per-row copies (forced off);
  * `quarter`: finished rows leave once they are a quarter of the batch (as before); else at once.

bench/vs_vllm.py's rollout shape: 4 GSM8K-easy chat prompts x 8 samples, 128 tokens (fixed) or RL-like
lengths (variable), temperature 1, one thread. One JSON line per round, then the profile's top ops.

    make smollm2 && python bench/row_attention.py full,runs,share --runs 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _smollm2 as sm  # noqa: E402
import rollout as rb  # noqa: E402

from grpolab.models import lean_decode  # noqa: E402
from grpolab.models.hf import load_hf  # noqa: E402
from grpolab.rollout import kv_cache  # noqa: E402

P, G, NEW = 4, 8, 128
ATTEND, MOVES = lean_decode.attend_runs, kv_cache.moves_rows


def one_call(q, k, v, mask, parts, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.size(1) != q.size(1))


def setting(name: str) -> None:
    lean_decode.attend_runs = one_call if "full" in name else ATTEND
    lean_decode.SHARE_MIN_BYTES = 0 if "share" in name else 2**62
    kv_cache.moves_rows = (lambda cache: False) if "quarter" in name else MOVES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("settings", help="comma-separated, e.g. full,runs,share")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = sm.DEFAULT_MODEL
    policy, tok = load_hf(str(model))
    policy.hf.eval()
    prompts = [tok.render_prompt(r["prompt"]) for r in sm.eval_rows(P, model, sm.Setting(max_new=NEW))]
    lengths = rb.rl_lengths(P * G, NEW)
    names = a.settings.split(",")

    def run(name, lens, seed, new=NEW):
        setting(name)
        with torch.inference_mode():
            return rb.m_ours(policy, prompts, G, new, tok.eos_id, tok.pad_id, seed, lens)
    for name in names:   # warm-up
        run(name, torch.full((P * G,), 16), 0)
    times = {n: {"fixed": [], "variable": []} for n in names}
    for i in range(a.runs):
        for name in names:
            times[name]["variable"].append(round(run(name, lengths, i + 1), 2))
            times[name]["fixed"].append(round(run(name, None, i + 1), 2))
        print(json.dumps({"round": i, "prompt_tokens": [len(p) for p in prompts], "seconds": times}), flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for name in names:
            setting(name)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with torch.inference_mode():
                    rb.m_ours(policy, prompts, G, 32, tok.eos_id, tok.pad_id, 300, None)
            ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in ev)
            print(json.dumps({"profile": name, "new_tokens": 32, "top_ops": [
                {"op": e.key, "calls": e.count, "self_s": round(e.self_cpu_time_total / 1e6, 3),
                 "share": round(e.self_cpu_time_total / total, 3)} for e in ev[:8]]}), flush=True)


if __name__ == "__main__":
    main()
