"""A small CNN on scikit-learn's handwritten digits (1797 real 8x8 images, shipped with the
package, so it runs offline)."""

import numpy as np
import torch
from torch import nn


def load_digits_split(test_fraction=0.2, seed=0):
    """(x_train, y_train, x_test, y_test) as tensors; x is N x 1 x 8 x 8 in [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.tensor(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


class DigitsCNN(nn.Module):
    """Conv layers of 144 and 4608 weights, a 64 x 512 fully connected layer: a mix of
    gradients that low-rank compressors send compressed and dense."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(make_optimizer, rank=0, size=1, epochs=8, batch_size=32, lr=0.05, seed=0, log=None, wrap=None):
    """Data-parallel training: rank r takes every size-th training example. ``make_optimizer``
    turns (model, torch optimizer) into the optimizer to step; ``wrap`` (optional) turns the
    model into the module that runs forward (a ``DistributedDataParallel``). Returns (model,
    test accuracy)."""
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits_split()
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    model = DigitsCNN()
    network = model if wrap is None else wrap(model)
    optimizer = make_optimizer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = len(y_train) // batch_size
    # Cosine decay: the final weights do not depend on where the last noisy step landed.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * steps_per_epoch)
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for step in range(steps_per_epoch):
            batch = order[step * batch_size : (step + 1) * batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(network(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item()
        if log is not None:
            log(epoch, total / steps_per_epoch, accuracy(model, x_test, y_test))
    return model, accuracy(model, x_test, y_test)
