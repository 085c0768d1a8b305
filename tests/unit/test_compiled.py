"""The compiled path (``config.compiled``, ``maths.compiled``) in a simulated world: ranks stay
bit-identical, every rank falls back to eager together, and the choice is agreed and
checkpointed. The tests that compile are marked slow: shapes are small and one bit width is
used, so they compile three graphs (QSGD's encode and decode at two ranks, Top-K's flags),
which inductor caches on disk for later runs; the others compile nothing."""

import logging

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld, run_alone
from hvd_compress.integration.agreement import verify_same_configuration
from hvd_compress.maths import quantize
from hvd_compress.maths.compiled import CompileFailed

# Two buckets a layer and a partial one, so the padding paths run: 3 x 128 + 64 entries.
SHAPES = {"a.weight": (7, 64), "b.weight": (16, 28), "a.bias": (7,)}
BUCKET = 128


def named():
    return [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]


def qsgd(compiled):
    return hc.QSGD(named(), bits=4, bucket_size=BUCKET, min_numel=256, compiled=compiled)


def gradients(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}


def steps(world, count=2):
    """The aggregates of ``count`` steps, each rank given its own gradients."""
    return [world.step([gradients(10 * step + rank) for rank in range(world.size)]) for step in range(count)]


@pytest.mark.slow
def test_compiled_ranks_agree_bit_for_bit_and_match_eager():
    compiled = SimulatedWorld([qsgd(True), qsgd(True)])
    eager = SimulatedWorld([qsgd(False), qsgd(False)])
    for fast, slow in zip(steps(compiled), steps(eager)):
        for name in SHAPES:
            assert torch.equal(fast[0][name], fast[1][name])
            # Inductor may round a norm or a fused multiply-add differently from eager.
            torch.testing.assert_close(fast[0][name], slow[0][name], rtol=1e-5, atol=1e-6)
    metrics = compiled.compressors[0].metrics()
    assert metrics["compiled"] == 1.0 and metrics["compiled_graphs"] >= 1 and metrics["compile_seconds"] > 0
    assert "compiled" not in eager.compressors[0].metrics()


@pytest.mark.slow
def test_compiled_kernels_give_eager_bytes_on_these_gradients():
    """Encode and decode compiled against eager: the same bytes here (norms of float64 sums
    rounded to float32, codes from the same noise)."""
    x, n = gradients(0)["a.weight"].reshape(-1), 448
    payloads = []
    for compiled in (False, True):
        packed, norms = torch.empty(quantize.packed_size(n, 4), dtype=torch.uint8), torch.empty(4)
        quantize.encode(x, 4, BUCKET, torch.Generator().manual_seed(3), packed, norms, compiled=compiled)
        payloads.append(torch.cat([packed, norms.view(torch.uint8)]))
    assert torch.equal(*payloads)
    rows = torch.stack([payloads[0], payloads[0]])
    codes, norms = rows[:, : quantize.packed_size(n, 4)], rows[:, quantize.packed_size(n, 4) :].view(torch.float32)
    assert torch.equal(
        quantize.decode_mean(codes, norms, 4, BUCKET, n),
        quantize.decode_mean(codes, norms, 4, BUCKET, n, compiled=True),
    )


def test_every_rank_falls_back_to_eager_when_one_cannot_compile(monkeypatch, caplog):
    working, broken = qsgd(True), qsgd(True)

    def fails(*_):
        raise CompileFailed("no C++ compiler") from OSError("gcc: not found")

    monkeypatch.setattr(working, "_warm_up", lambda *_: None)  # compiled, as far as it knows
    monkeypatch.setattr(broken, "_warm_up", fails)
    with caplog.at_level(logging.WARNING):
        world = SimulatedWorld([working, broken])
    assert [c.compiled_path.compiles for c in world.compressors] == [False, False]
    assert [r.getMessage() for r in caplog.records].count(
        "QSGD: compiled=True, but torch.compile failed on rank(s) [1]; its kernels run eagerly from now on"
    ) == 1
    assert "(here: gcc: not found)" in caplog.records[-1].getMessage()
    eager = SimulatedWorld([qsgd(False), qsgd(False)])
    for fallen, slow in zip(steps(world), steps(eager)):
        assert all(torch.equal(fallen[r][name], slow[r][name]) for r in range(2) for name in SHAPES)
    assert world.compressors[0].metrics()["compiled"] == 0.0


def test_an_unbound_compressor_falls_back_alone_where_a_kernel_fails(monkeypatch, caplog):
    def fails(*_, **__):
        raise CompileFailed("inductor failed")

    monkeypatch.setattr(quantize._encode_chunk, "compiled", fails)
    compressor = qsgd(True)
    with caplog.at_level(logging.WARNING):
        result = run_alone(compressor.begin("a.weight", gradients(0)["a.weight"]))
    assert not compressor.compiled_path.compiles and "inductor failed" in caplog.text
    reference = qsgd(False)
    assert torch.equal(result, run_alone(reference.begin("a.weight", gradients(0)["a.weight"])))


class Twin:
    """A transport of two ranks whose other rank describes ``theirs``."""

    rank = 0

    def __init__(self, theirs):
        self.theirs = theirs

    def allgather(self, obj, tag, deadline, what):
        return [obj, {"configuration": self.theirs, "compiled_ready": True}]


def test_agreement_refuses_ranks_that_differ_on_compiled():
    with pytest.raises(ValueError, match="QSGD: compiled is False on rank 0 but True on rank 1"):
        verify_same_configuration(qsgd(False), Twin(qsgd(True).describe()))
    assert verify_same_configuration(qsgd(True), Twin(qsgd(True).describe()), compiled_ready=False) == [False, True]


def test_a_checkpoint_of_the_other_path_is_refused_and_an_older_one_is_eager():
    checkpoint = qsgd(True).state_dict()
    with pytest.raises(ValueError, match="compiled is True in the checkpoint but False here"):
        qsgd(False).load_state_dict(checkpoint)
    older = dict(checkpoint, config={k: v for k, v in checkpoint["config"].items() if k != "compiled"})
    qsgd(False).load_state_dict(older)
    with pytest.raises(ValueError, match="compiled is False in the checkpoint but True here"):
        qsgd(True).load_state_dict(older)


@pytest.mark.slow
def test_compiled_topk_selects_as_eager_bit_for_bit():
    """Top-K's candidates' flags compiled: the same indices, so the same bytes everywhere (a layer
    large enough for the sampled threshold: 2^15 entries at 1%)."""
    shapes = {"w": (256, 128)}

    def topk(compiled):
        return hc.TopK(
            [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in shapes.items()],
            density=0.01,
            compiled=compiled,
        )

    def grads(seed):
        return {"w": torch.randn(*shapes["w"], generator=torch.Generator().manual_seed(seed))}

    compiled, eager = SimulatedWorld([topk(True), topk(True)]), SimulatedWorld([topk(False), topk(False)])
    for step in range(3):
        fast, slow = (world.step([grads(10 * step), grads(10 * step + 1)]) for world in (compiled, eager))
        assert torch.equal(fast[0]["w"], fast[1]["w"]) and torch.equal(fast[0]["w"], slow[0]["w"])
    assert compiled.compressors[0].metrics()["compiled"] == 1.0
