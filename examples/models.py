"""Model factories for ``python -m hvd_compress.advise --model examples.models:<name>``.

A factory takes no argument and returns ``(model, loss_of)``: ``loss_of(model)`` is the loss of
one fresh batch of this rank (what ``advise`` times for compute). The models are the end-to-end
benchmark's (``benchmarks/endtoend.py``), so advice and measurement are about the same work:

    mpirun -np 4 python -m hvd_compress.advise --model examples.models:charlm
"""

import torch

from benchmarks.endtoend import WORKLOADS


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


def _character_lm(model_options, sequences, max_chars):
    """A character transformer on the standard library's source, ``sequences`` per rank and step."""
    from examples.workloads.charlm import CharTransformer, batches, cross_entropy, load_corpus

    model = CharTransformer(**model_options)
    train_ids, _ = load_corpus(max_chars=max_chars)
    data = batches(train_ids, sequences, model.context, torch.Generator().manual_seed(0))

    def loss_of(model):
        x, y = next(data)
        return cross_entropy(model, x, y)

    return model, loss_of


def charlm_small():
    """A two-layer character transformer (d_model 128): quick to advise on, for tests."""
    return _character_lm({"d_model": 128, "layers": 2, "heads": 4, "context": 64}, 4, 100_000)


def charlm_ttq():
    """The character LM of "Time to quality" (``benchmarks.quality.LM``: d_model 64, 2 layers,
    135,168 parameters), 16 sequences of 32 bytes per rank and step."""
    from benchmarks.quality import LM

    return _character_lm(LM["model"], LM["batch_size"], LM["max_chars"])
