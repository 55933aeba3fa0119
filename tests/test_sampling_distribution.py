"""The sampler draws from the distribution it claims: token frequencies from `generate` against
probabilities computed plainly here from the model's logits (temperature, top-k, top-p)."""

import math

import pytest
import torch

from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys

N = 20000   # draws per case: a frequency is then within ~0.0035 of its probability (1 sigma at p=0.5)


def _plain_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T), restricted to the top-k tokens, then to the smallest set of the most likely
    tokens whose mass reaches top_p, renormalised. Written out without tensors."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order[:top_k]) if top_k else set(order)
    total = sum(e[i] for i in keep)
    nucleus, mass = set(), 0.0
    for i in order:
        if i not in keep:
            continue
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += e[i] / total
    z_n = sum(e[i] for i in nucleus)
    return [e[i] / z_n if i in nucleus else 0.0 for i in range(len(z))]


@pytest.fixture
def peaked_gpt(tiny_gpt):
    """The random tiny GPT with a sharper head, so that top-k and top-p cut real probability mass."""
    with torch.no_grad():
        tiny_gpt.lm_head.weight.mul_(6.0)
    return tiny_gpt


def _check(freq: list[float], probs: list[float]) -> None:
    for i, (f, p) in enumerate(zip(freq, probs)):
        if p == 0.0:
            assert f == 0.0, f"token {i} has probability 0 but was drawn {f * N:.0f} times"
        else:   # 5 sigma of a binomial frequency, plus a hair for p near 0
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / N) + 1e-4, (i, f, p)


def _randomness(keyed: bool) -> dict:
    """generate()'s randomness: keyed per completion (what training and eval use), or one generator."""
    if keyed:   # N samples of one prompt draw: keys (seed 1, draw 0, sample j)
        return {"keys": completion_keys(1, torch.zeros(N, dtype=torch.long), torch.arange(N))}
    return {"generator": torch.Generator().manual_seed(1)}


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "generator"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                     (1.0, 0, 0.8), (0.8, 8, 0.9)])
def test_first_and_second_token_frequencies_match_the_exact_probabilities(peaked_gpt, tok, temperature,
                                                                          top_k, top_p, keyed):
    model = peaked_gpt
    prompt = tok.render_prompt("Sam has 3 apples.")
    gen = generate(model, [prompt], num_generations=N, max_new_tokens=2, temperature=temperature,
                   top_k=top_k, top_p=top_p, stop_ids=(), pad_id=tok.pad_id, **_randomness(keyed))
    V = model.config.vocab_size
    with torch.no_grad():
        first_logits = model(torch.tensor([prompt]))[0, -1].tolist()
    probs = _plain_probs(first_logits, temperature, top_k, top_p)
    assert sum(p > 0 for p in probs) > 3   # the case restricts a real distribution, not one token
    first = gen.completion_ids[:, 0]
    freq = torch.bincount(first, minlength=V).double().div(N).tolist()
    _check(freq, probs)

    # the second token, drawn through the KV cache, given the most common first token
    t1 = int(first.mode().values)
    rows = first == t1
    n = int(rows.sum())
    with torch.no_grad():
        second_logits = model(torch.tensor([prompt + [t1]]))[0, -1].tolist()
    probs2 = _plain_probs(second_logits, temperature, top_k, top_p)
    freq2 = torch.bincount(gen.completion_ids[rows, 1], minlength=V).double().div(n).tolist()
    for i, (f, p) in enumerate(zip(freq2, probs2)):
        assert (f == 0.0) if p == 0.0 else abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-4, (i, f, p)

    # the recorded log-prob is that of the tempered full distribution (what the trainer recomputes)
    z = torch.tensor(first_logits) / temperature
    want = z.log_softmax(-1)[first]
    torch.testing.assert_close(gen.sampler_logprobs[:, 0], want, atol=1e-5, rtol=0)


def test_a_wrong_temperature_would_fail_the_frequency_check(peaked_gpt, tok):
    """The check above has power: frequencies at T=1 are far from the T=0.7 probabilities."""
    model = peaked_gpt
    prompt = tok.render_prompt("Sam has 3 apples.")
    gen = generate(model, [prompt], num_generations=N, max_new_tokens=1, temperature=1.0, stop_ids=(),
                   pad_id=tok.pad_id, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].tolist()
    freq = torch.bincount(gen.completion_ids[:, 0], minlength=len(logits)).double().div(N).tolist()
    _check(freq, _plain_probs(logits, 1.0, 0, 1.0))
    with pytest.raises(AssertionError):
        _check(freq, _plain_probs(logits, 0.7, 0, 1.0))


def test_keyed_completions_do_not_depend_on_the_batch(tiny_gpt, tok):
    """The same keys give the same completions in one batch of 6 prompts, or prompt by prompt."""
    prompts = [tok.render_prompt(f"Sam has {i} apples and buys {i + 3} more.") for i in range(6)]
    G = 4
    draws = torch.arange(100, 106)
    keys = completion_keys(7, draws.repeat_interleave(G), torch.arange(G).repeat(6))
    kw = dict(num_generations=G, max_new_tokens=12, temperature=1.0, stop_ids=(), pad_id=tok.pad_id)
    whole = generate(tiny_gpt, prompts, keys=keys, **kw)
    for i, p in enumerate(prompts):
        one = generate(tiny_gpt, [p], keys=keys[i * G:(i + 1) * G], **kw)
        assert torch.equal(one.completion_ids, whole.completion_ids[i * G:(i + 1) * G]), i
    # and the keys matter: another seed draws other completions
    other = generate(tiny_gpt, prompts, keys=completion_keys(8, draws.repeat_interleave(G),
                                                              torch.arange(G).repeat(6)), **kw)
    assert not torch.equal(other.completion_ids, whole.completion_ids)


def test_blocked_cdf_inversion_draws_the_exact_distribution_and_matches_one_cumulative_sum():
    """Large vocabularies invert the CDF in two levels (a block, then a token in it). Over a 1,000-token
    distribution in blocks of 64 (the last block short) with whole blocks and scattered tokens at zero
    probability: frequencies match, zeros are never drawn, and each uniform picks the token the plain
    single cumulative sum picks."""
    from grpolab.rollout.sampling import draw
    g = torch.Generator().manual_seed(0)
    V = 1000
    w = torch.rand(V, generator=g, dtype=torch.float64) ** 4
    w[128:192] = 0.0          # a whole block
    w[::7] = 0.0              # scattered zeros, in the short last block too
    w[990:] = 0.0
    w[999] = 0.5              # the very last token is likely
    probs = (w / w.sum()).float()
    u = torch.rand(N, 1, generator=g, dtype=torch.float64)
    blocked = draw(probs.expand(N, V), None, u, block=64)
    freq = torch.bincount(blocked, minlength=V).double().div(N).tolist()
    _check(freq, probs.double().tolist())

    # the plain method, written out: first index whose float64 running sum exceeds u * total
    cdf = probs.double().cumsum(0)
    plain = torch.searchsorted(cdf, (u * cdf[-1]).squeeze(1), right=True)
    assert (blocked == plain).double().mean() > 0.999   # only a boundary within float rounding may differ
    assert probs[blocked].min() > 0
    # the edges of the unit interval: u = 0 gives the first token of nonzero probability
    edge = draw(probs[None].expand(2, V), None, torch.tensor([[0.0], [1.0 - 2.0 ** -53]], dtype=torch.float64),
                block=64)
    assert edge.tolist() == [int((probs > 0).nonzero()[0]), 999]
