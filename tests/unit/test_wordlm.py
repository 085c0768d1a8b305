"""The word-level GPT workload: a skewed vocabulary built the same way every time, and a model
whose embedding and head hold most parameters."""

import torch

from examples.workloads import charlm, wordlm


def test_vocabulary_is_skewed_and_the_same_every_time():
    train_ids, val_ids, tokens = wordlm.load_corpus(200_000, 512)
    wordlm.load_corpus.cache_clear()
    again = wordlm.load_corpus(200_000, 512)
    assert tokens == again[2] and torch.equal(train_ids, again[0])
    assert len(tokens) == 512 and tokens[wordlm.UNKNOWN] == "<unk>"
    assert int(train_ids.max()) < 512 and len(val_ids) * 9 < len(train_ids) < len(val_ids) * 10
    counts = torch.bincount(train_ids, minlength=512)[1:]
    assert counts[0] > 50 * counts[-1] > 0  # Zipf: the top token against the 511th
    assert "def" in tokens and "self" in tokens and "\n    " in tokens


def test_embedding_and_head_hold_most_parameters():
    model = charlm.CharTransformer(vocab=wordlm.VOCAB, d_model=64, layers=4, heads=4, context=64)
    sizes = dict((name, p.numel()) for name, p in model.named_parameters())
    assert model.token_embedding.weight is not model.head.weight
    assert sizes["token_embedding.weight"] + sizes["head.weight"] > 0.5 * sum(sizes.values())
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    assert len(shapes) >= 5
