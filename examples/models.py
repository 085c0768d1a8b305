"""Model factories for ``python -m hvd_compress.advise --model examples.models:<name>``.

A factory takes no argument and returns ``(model, loss_of)``: ``loss_of(model)`` is the loss of
one fresh batch of this rank (what ``advise`` times for compute). The models are the end-to-end
benchmark's (``benchmarks/endtoend.py``), so advice and measurement are about the same work:

    mpirun -np 4 python -m hvd_compress.advise --model examples.models:charlm
"""
import sys
from pathlib import Path

import torch

# The workloads live in the repository's benchmarks/, outside the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.endtoend import WORKLOADS  # noqa: E402


def _with_loss(workload):
    model, batches, loss_of_batch = workload(torch.Generator().manual_seed(0))

    def loss_of(model):
        x, y = next(batches)
        return loss_of_batch(model, x, y)

    return model, loss_of


def charlm():
    """The character transformer: d_model 256, 24 layers, 19.1 M parameters, one 64-token
    sequence per rank and step."""
    return _with_loss(WORKLOADS["charlm"])


def cnn():
    """SmallVGG on synthetic 32 x 32 images, 16 per rank and step."""
    return _with_loss(WORKLOADS["cnn"])


def charlm_small():
    """A two-layer character transformer (d_model 128): quick to advise on, for tests."""
    from benchmarks.workloads.charlm import CharTransformer, batches, cross_entropy, load_corpus
    model = CharTransformer(d_model=128, layers=2, heads=4, context=64)
    train_ids, _ = load_corpus(max_chars=100_000)
    data = batches(train_ids, 4, 64, torch.Generator().manual_seed(0))

    def loss_of(model):
        x, y = next(data)
        return cross_entropy(model, x, y)

    return model, loss_of
