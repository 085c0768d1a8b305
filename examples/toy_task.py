"""The quickstart examples' task: a small MLP trained on random batches, so that each example
shows only the lines an integration adds. Run the examples from the checkout's root."""

import torch


def small_model(seed: int = 0) -> torch.nn.Module:
    """Two linear layers, large enough for PowerSGD to compress (256 x 256)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 20) -> float:
    """``steps`` steps of cross-entropy on random batches; returns the last loss."""
    for _ in range(steps):
        inputs, labels = torch.randn(32, 256), torch.randint(0, 10, (32,))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
    return loss.item()
