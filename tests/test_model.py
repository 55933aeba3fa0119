import torch

from grpolab.utils.padding import pad_sequences


def test_kv_cache_decoding_equals_full_recomputation(tiny_gpt):
    torch.manual_seed(1)
    ids = torch.randint(0, 90, (3, 20))
    full = tiny_gpt(ids)
    cache = tiny_gpt.new_cache(3, 20)
    parts = [tiny_gpt(ids[:, :8], cache=cache)]
    for t in range(8, 20):
        parts.append(tiny_gpt(ids[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_left_padding_does_not_change_a_row(tiny_gpt):
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    ids, mask = pad_sequences([a, b], pad_id=0, side="left")
    padded = tiny_gpt(ids, key_valid=mask)
    alone = tiny_gpt(torch.tensor([b]))
    torch.testing.assert_close(padded[1, -3:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[0], tiny_gpt(torch.tensor([a]))[0], atol=1e-5, rtol=1e-5)


def test_sequence_longer_than_block_size_is_refused(tiny_gpt):
    import pytest
    with pytest.raises(ValueError, match="block_size"):
        tiny_gpt(torch.zeros(1, tiny_gpt.config.block_size + 1, dtype=torch.long))
