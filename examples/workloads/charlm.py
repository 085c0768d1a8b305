"""A small GPT-style character language model on the Python standard library's own source.

The corpus is the top-level ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), in sorted order, concatenated and cut to ``max_chars``
bytes. It is real text with long-range structure (indentation, names defined and reused), it is
on every machine that runs Python, so nothing is downloaded, and it is fixed for a given Python
version. The vocabulary is the 256 byte values, so the model's shapes never depend on the corpus
(the text itself changes a little between Python versions). The last 10% is validation.
"""

import math
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256
VALIDATION_FRACTION = 0.1


def load_corpus(max_chars=2_000_000):
    """(train_ids, val_ids): 1-D int64 tensors of byte values, split at 90% of the text."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= max_chars:
            break
        try:
            chunk = path.read_bytes()
        except OSError:
            continue
        chunks.append(chunk)
        total += len(chunk)
    text = b"".join(chunks)[:max_chars]
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n_train = len(ids) - int(len(ids) * VALIDATION_FRACTION)
    return ids[:n_train], ids[n_train:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x-wide MLP."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 4 * d_model)
        self.mlp_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        batch, length, d_model = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, -1).transpose(1, 2)
            for t in self.qkv(self.attention_norm(x)).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d_model))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class CharTransformer(nn.Module):
    """Decoder-only transformer over bytes. Its 2-D weights come in several shapes (embeddings
    256 x d and context x d, qkv 3d x d, proj d x d, MLP 4d x d and d x 4d, head 256 x d) next
    to 1-D biases and norms, so low-rank and sparsifying compressors see a realistic mix."""

    def __init__(self, vocab=VOCAB, d_model=128, layers=2, heads=4, context=64):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        # GPT-2's small initialisation: unit-variance embeddings would swamp the residual stream.
        for name, param in self.named_parameters():
            if param.dim() == 2:
                nn.init.normal_(param, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def batches(ids, batch_size, context, generator):
    """Endless (x, y) batches of random windows; y is x shifted one byte ahead."""
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(len(ids) - context, (batch_size, 1), generator=generator)
        windows = ids[starts + offsets]
        yield windows[:, :-1], windows[:, 1:]


def cross_entropy(model, x, y):
    logits = model(x)  # the model or a wrapper of it (DistributedDataParallel)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def evaluate(model, val_ids, context, windows=256, batch_size=64):
    """Perplexity: exp of the mean cross-entropy over ``windows`` evenly spaced validation
    windows, the same ones on every call."""
    offsets = torch.arange(context + 1)
    starts = torch.linspace(0, len(val_ids) - context - 1, windows).long().unsqueeze(1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for first in range(0, windows, batch_size):
            batch = val_ids[starts[first : first + batch_size] + offsets].to(device)
            total += cross_entropy(model, batch[:, :-1], batch[:, 1:]).item() * len(batch)
    model.train(was_training)
    return math.exp(total / windows)


def train(
    make_optimizer,
    rank=0,
    size=1,
    steps=300,
    batch_size=32,
    lr=2e-3,
    seed=0,
    log=None,
    log_every=50,
    model_kwargs=None,
    max_chars=2_000_000,
):
    """Data-parallel training of a ``CharTransformer(**model_kwargs)`` on the corpus's first
    ``max_chars`` bytes: see ``fit``. Returns (model, validation perplexity)."""
    torch.manual_seed(seed)
    train_ids, val_ids = load_corpus(max_chars)
    return fit(
        make_optimizer,
        CharTransformer(**(model_kwargs or {})),
        train_ids,
        val_ids,
        rank,
        size,
        steps,
        batch_size,
        lr,
        seed,
        log,
        log_every,
    )


def fit(
    make_optimizer,
    model,
    train_ids,
    val_ids,
    rank=0,
    size=1,
    steps=300,
    batch_size=32,
    lr=2e-3,
    seed=0,
    log=None,
    log_every=50,
):
    """Data-parallel training with AdamW, a linear warmup over the first 10% of the steps
    (``warmup_steps``), then cosine decay to a tenth of ``lr``. Every rank draws its own random
    windows from the whole training text, so the ranks together sample like one process with
    ``size`` times the batch. ``make_optimizer`` turns (model, torch optimizer) into the
    optimizer to step; ``log(step, mean training loss since the last call, validation
    perplexity)`` is called every ``log_every`` steps and after the last. The caller seeds torch
    before building ``model``. Returns (model, validation perplexity)."""
    optimizer = make_optimizer(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01))
    warmup = warmup_steps(steps)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    # size * seed + rank: distinct streams for every (seed, rank) pair at a given size.
    generator = torch.Generator().manual_seed(size * seed + rank)
    data = batches(train_ids, batch_size, model.context, generator)
    device = next(model.parameters()).device  # batches are drawn on the CPU, the same on any device
    total, since_log = 0.0, 0
    for step in range(steps):
        x, y = (t.to(device) for t in next(data))
        optimizer.zero_grad()
        loss = cross_entropy(model, x, y)
        loss.backward()
        optimizer.step()
        schedule.step()
        total, since_log = total + loss.item(), since_log + 1
        if log is not None and ((step + 1) % log_every == 0 or step + 1 == steps):
            log(step + 1, total / since_log, evaluate(model, val_ids, model.context))
            total, since_log = 0.0, 0
    return model, evaluate(model, val_ids, model.context)


def warmup_steps(steps):
    """The learning-rate warm-up of a ``steps``-step run of ``fit``."""
    return max(1, steps // 10)
