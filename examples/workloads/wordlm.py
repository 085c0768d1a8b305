"""A GPT-style word-level language model on the Python standard library's own source: the
workload on which layer-wise compression has something to find.

Compared with the character LM (``charlm``), its vocabulary is large and Zipf-skewed: the
``VOCAB - 1`` most frequent tokens of the training text plus one for the rest, so the token
embedding and the (separate) output head hold most of the parameters, and in any one step most
embedding rows get no gradient at all. With several blocks its 2-D weights come in seven shapes.

Tokens: identifiers, numbers, a newline with the indentation that follows it, runs of spaces, and
single other characters (``TOKEN``). The corpus is ``charlm.load_corpus``'s text (the top-level
``*.py`` files of the running interpreter's standard library, sorted), so nothing is downloaded;
the vocabulary is built from the training 90% with ties broken by the token's text, so it is the
same on every rank and every run of a given Python version.
"""

import functools
import re
from collections import Counter

import torch

from . import charlm

VOCAB = 4096
UNKNOWN = 0
TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|\n[ \t]*|[ \t]+|.", re.DOTALL)


@functools.lru_cache(maxsize=2)
def load_corpus(max_chars=3_000_000, vocab=VOCAB):
    """(train_ids, val_ids, tokens): int64 token ids split at 90% of the token stream, and the
    vocabulary (``tokens[i]`` is id ``i``; id 0 stands for every token outside it)."""
    train_bytes, val_bytes = charlm.load_corpus(max_chars)
    text = bytes(train_bytes.to(torch.uint8).tolist() + val_bytes.to(torch.uint8).tolist()).decode("latin-1")
    pieces = TOKEN.findall(text)
    cut = len(pieces) - int(len(pieces) * charlm.VALIDATION_FRACTION)
    counts = Counter(pieces[:cut])
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[: vocab - 1]
    tokens = ["<unk>"] + [token for token, _ in ranked]
    index = {token: i for i, token in enumerate(tokens)}
    ids = torch.tensor([index.get(piece, UNKNOWN) for piece in pieces], dtype=torch.int64)
    return ids[:cut], ids[cut:], tuple(tokens)


def train(
    make_optimizer,
    rank=0,
    size=1,
    steps=600,
    batch_size=32,
    lr=2e-3,
    seed=0,
    log=None,
    log_every=50,
    model_kwargs=None,
    max_chars=3_000_000,
    vocab=VOCAB,
    prepare=None,
):
    """As ``charlm.train``, on word-level tokens: a ``charlm.CharTransformer`` with a
    ``vocab``-token embedding and head (``model_kwargs`` sets the rest). ``prepare`` turns the
    new model into the one trained (moved to a device, wrapped in DistributedDataParallel).
    Deterministic for a given seed and world size. Returns (model, validation perplexity over
    tokens)."""
    torch.manual_seed(seed)
    train_ids, val_ids, _ = load_corpus(max_chars, vocab)
    model = charlm.CharTransformer(vocab=vocab, **(model_kwargs or {}))
    if prepare is not None:
        model = prepare(model)
    return charlm.fit(
        make_optimizer, model, train_ids, val_ids, rank, size, steps, batch_size, lr, seed, log, log_every
    )
