"""The character-level transformer on the standard library's source: corpus, learning,
determinism. Small runs of the default model; about 15 s of CPU."""

import pytest
import torch

from examples.workloads import charlm


def unchanged(model, optimizer):
    return optimizer


@pytest.fixture(scope="module")
def corpus():
    return charlm.load_corpus()


def test_corpus_is_real_text_split_nine_to_one(corpus):
    train_ids, val_ids = corpus
    total = len(train_ids) + len(val_ids)
    assert total > 100_000
    assert len(val_ids) == int(total * charlm.VALIDATION_FRACTION)
    for ids in corpus:
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert 0 <= ids.min() and ids.max() < charlm.VOCAB
    assert b"def " in bytes(train_ids[:20_000].tolist())


def test_corpus_respects_max_chars():
    train_ids, val_ids = charlm.load_corpus(max_chars=150_000)
    assert (len(train_ids), len(val_ids)) == (135_000, 15_000)


def test_batches_are_shifted_windows(corpus):
    train_ids, _ = corpus
    x, y = next(charlm.batches(train_ids, 8, 16, torch.Generator().manual_seed(0)))
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.slow
def test_short_training_lowers_validation_perplexity(corpus):
    torch.manual_seed(0)
    untrained = charlm.evaluate(charlm.CharTransformer(), corpus[1], context=64)
    _, trained = charlm.train(unchanged, steps=80)
    print(f"\nvalidation perplexity {untrained:.1f} untrained, {trained:.2f} after 80 steps")
    assert untrained > 200  # about uniform over 256 bytes
    assert trained < 20


@pytest.mark.slow
def test_training_is_deterministic_for_a_seed():
    first, ppl_first = charlm.train(unchanged, steps=15)
    second, ppl_second = charlm.train(unchanged, steps=15)
    assert ppl_first == ppl_second
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
