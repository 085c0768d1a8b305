"""QuantizedAllReduce: the two hops against a float64 reference, bit-identical ranks, error
feedback's mass on both hops, bytes, checkpoints and world changes."""

import io
import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.maths import absmax

SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (33, 70), "fc.bias": (33,)}


def gradients(step, rank, shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {name: torch.randn(*shape, generator=g) * (1 + rank) for name, shape in shapes.items()}


def world(size, **options):
    options = dict({"min_numel": 0, "block_size": 64}, **options)
    return SimulatedWorld([hc.QuantizedAllReduce(**options) for _ in range(size)])


def quantized64(x, bits, block):
    """Per-block absmax, round to nearest, in float64: (values, residual) of rows ``x``."""
    s = (1 << (bits - 1)) - 1
    rows, length = x.shape
    blocks = torch.nn.functional.pad(x, (0, (-length) % block)).view(rows, -1, block)
    scales = blocks.abs().amax(dim=2, keepdim=True) / s
    values = (blocks / torch.where(scales > 0, scales, 1.0)).round().clamp(-s, s) * scales
    values = values.reshape(rows, -1)[:, :length]
    return values, x - values


class Reference:
    """The two-hop algorithm in float64: error feedback on both hops, chunk j owned by rank j."""

    def __init__(self, size, bits, block):
        self.size, self.bits, self.block = size, bits, block
        self.worker, self.owner = {}, {}

    def step(self, grads_per_rank):
        w = self.size
        results = {}
        for name in grads_per_rank[0]:
            n = grads_per_rank[0][name].numel()
            if grads_per_rank[0][name].dim() < 2:
                results[name] = sum(g[name].double() for g in grads_per_rank) / w
                continue
            c = -(-(-(-n // w)) // 32) * 32
            sent = []
            for rank, grads in enumerate(grads_per_rank):
                x = grads[name].double().reshape(-1) + self.worker.get((name, rank), 0)
                chunks = torch.nn.functional.pad(x, (0, w * c - n)).view(w, c)
                values, residual = quantized64(chunks, self.bits, self.block)
                self.worker[(name, rank)] = residual.reshape(-1)[:n]
                sent.append(values)
            mean = torch.stack(sent).sum(dim=0) / w  # (W, c): row j, owner j's mean
            s = mean + torch.stack([self.owner.get((name, j), torch.zeros(c, dtype=torch.float64)) for j in range(w)])
            values, residual = quantized64(s, self.bits, self.block)
            for j in range(w):
                self.owner[(name, j)] = residual[j]
            results[name] = values.reshape(-1)[:n].view(grads_per_rank[0][name].shape)
        return results


@pytest.mark.parametrize("size,bits", [(2, 8), (3, 4), (4, 4), (4, 2)])
def test_equals_float64_reference_and_ranks_bit_identical(size, bits):
    simulated, reference = world(size, bits=bits), Reference(size, bits, 64)
    for step in range(4):
        grads = [gradients(step, rank) for rank in range(size)]
        results = simulated.step(grads)
        expected = reference.step(grads)
        for name in SHAPES:
            assert all(torch.equal(results[0][name], other[name]) for other in results[1:])
            got, want = results[0][name].double(), expected[name]
            # Float32 against float64 may round a code the other way where a value sits on a
            # tie: at most one step of the owner's quantiser, on a few entries.
            step_size = want.abs().max() / ((1 << (bits - 1)) - 1)
            assert (got - want).abs().max() <= 1.01 * step_size
            assert torch.isclose(got, want, rtol=1e-5, atol=1e-6).double().mean() > 0.99


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_conserves_mass(bits):
    size = 3
    simulated = world(size, bits=bits)
    inputs = 0.0
    delivered = 0.0
    for step in range(6):
        grads = [gradients(step, rank) for rank in range(size)]
        results = simulated.step(grads)
        name = "fc.weight"
        inputs += sum(g[name].double().sum() for g in grads)
        delivered += size * results[0][name].double().sum()
    held = sum(
        c.residual(name).double().sum() + size * c.owned.residual(name).double().sum() for c in simulated.compressors
    )
    assert held != 0
    assert abs(float(delivered + held - inputs)) <= 1e-4 * float(abs(inputs) + 1)


def test_bytes_match_traffic():
    size, bits, block = 4, 4, 64
    simulated = world(size, bits=bits, block_size=block)
    shape = SHAPES["fc.weight"]
    simulated.step([{"fc.weight": gradients(0, rank)["fc.weight"]} for rank in range(size)])
    compressor = simulated.compressors[0]
    n = math.prod(shape)
    c = compressor.chunk_entries(n)
    row = c * bits // 8 + 4 * -(-c // block)
    assert compressor.tuning.payload_bytes(shape, bits) == (size + 1) * row
    dense, payload, wire = compressor.traffic.last_step
    assert payload == (size + 1) * row
    assert wire == 2 * (size - 1) * row
    # About 2 (W-1)/W (n bits/8 + scales), within the padding of the last chunk.
    assert wire == pytest.approx(2 * (size - 1) / size * (n * bits / 8 + 4 * n / block), rel=0.1)


def test_codes_pack_and_unpack():
    x = torch.randn(3, 96) * 5
    for bits in absmax.BYTE_ALIGNED_BITS:
        codes, scales = absmax.quantize_rows(x, bits, 40)
        assert codes.abs().max() <= (1 << (bits - 1)) - 1
        payload = absmax.pack_rows(codes, scales, bits)
        assert payload.shape == (3, absmax.row_bytes(96, bits, 40))
        back, back_scales = absmax.unpack_rows(payload, bits, 96, 40)
        assert torch.equal(back, codes) and torch.equal(back_scales, scales)


def test_non_finite_input_reaches_every_rank_and_leaves_no_trace():
    simulated = world(2, bits=4)
    simulated.step([gradients(0, rank) for rank in range(2)])
    before = [c.state_dict() for c in simulated.compressors]
    bad = [gradients(1, rank) for rank in range(2)]
    bad[1]["fc.weight"][3, 5] = float("inf")
    results = simulated.step(bad)
    assert all(not torch.isfinite(r["fc.weight"]).all() for r in results)
    for compressor, saved in zip(simulated.compressors, before):
        assert not compressor.last_step_finite
        after = compressor.state_dict()
        for key in ("residuals", "owner_residuals"):
            assert all(torch.equal(after[key][n], saved[key][n]) for n in saved[key])


def saved_and_loaded(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_checkpoint_round_trip_keeps_both_residuals():
    first, resumed = world(3, bits=4), world(3, bits=4)
    for step in range(3):
        first.step([gradients(step, rank) for rank in range(3)])
    for source, target in zip(first.compressors, resumed.compressors):
        state = saved_and_loaded(source.state_dict())
        assert set(state["owner_residuals"]) == {"conv.weight", "fc.weight"}
        target.load_state_dict(state)
    for step in range(3, 6):
        grads = [gradients(step, rank) for rank in range(3)]
        for a, b in zip(first.step(grads), resumed.step(grads)):
            assert all(torch.equal(a[n], b[n]) for n in SHAPES)


def test_checkpoint_that_does_not_fit_is_refused_whole():
    source = world(2, bits=4)
    source.step([gradients(0, rank) for rank in range(2)])
    state = source.compressors[0].state_dict()
    state["owner_residuals"]["fc.weight"] = torch.zeros(5)
    target = world(2, bits=4).compressors[0]
    with pytest.raises(ValueError, match="fc.weight"):
        target.load_state_dict(state)
    assert target.residual("fc.weight") is None


def test_world_change_drops_owner_residuals_and_keeps_worker_ones():
    before = world(4, bits=4)
    before.step([gradients(0, rank) for rank in range(4)])
    compressor = before.compressors[1]
    own = compressor.state_dict()
    # The same rank of the same W (a restore): both kept.
    same = compressor.world_change_state(own, own=own, rank=1, size=4)
    assert set(same["owner_residuals"]) == set(own["owner_residuals"])
    # Another W: this process's e_w kept ("keep"), e_s dropped; and it runs at the new W.
    changed = compressor.world_change_state(own, own=own, rank=1, size=2)
    assert changed["owner_residuals"] == {} and set(changed["residuals"]) == set(own["residuals"])
    after = world(2, bits=4)
    after.compressors[1].load_state_dict(changed)
    assert torch.equal(after.compressors[1].residual("fc.weight"), own["residuals"]["fc.weight"])
    assert after.compressors[1].owned.residual("fc.weight") is None
    results = after.step([gradients(1, rank) for rank in range(2)])
    assert torch.equal(results[0]["fc.weight"], results[1]["fc.weight"])
    # Rebinding to another rank or W drops the owner's residuals as well.
    compressor.bind_world(0, 3)
    assert compressor.owned.residual("fc.weight") is None
    assert compressor.residual("fc.weight") is not None
    # A checkpoint from another rank brings neither residual.
    other = world(4, bits=4).compressors[2]
    other.load_state_dict(own)
    assert other.residual("fc.weight") is None and other.owned.residual("fc.weight") is None


def test_dense_phase_takes_both_residuals_along():
    size = 2
    simulated = world(size, bits=2)
    simulated.step([gradients(0, rank) for rank in range(size)])
    held = sum(
        c.residual("fc.weight").double().sum() + size * c.owned.residual("fc.weight").double().sum()
        for c in simulated.compressors
    )
    zero = {"fc.weight": torch.zeros(SHAPES["fc.weight"])}
    rounds = [c.begin_uncompressed("fc.weight", zero["fc.weight"]) for c in simulated.compressors]
    from hvd_compress.comm.simulated import aggregate

    results = [r.then(got) for r, got in zip(rounds, aggregate(rounds))]
    for c in simulated.compressors:
        c.end_step()
        assert c.residual("fc.weight") is None and c.owned.residual("fc.weight") is None
    assert float(size * results[0].double().sum()) == pytest.approx(float(held), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize(
    "options,parameter",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2.5}, "block_size"),
        ({"bits": 3}, "bits"),
        ({"bits": 16}, "bits"),
    ],
)
def test_bad_options_name_the_parameter(options, parameter):
    with pytest.raises(ValueError, match=parameter):
        hc.QuantizedAllReduce(**options)


def test_controllers_set_bits_per_layer():
    compressor = hc.QuantizedAllReduce(bits=4)
    assert compressor.tuning.candidates((64, 64), 4) == [2, 4, 8]
    assert compressor.tuning.candidates((64, 64), 8) == [4, 8]
    assert compressor.tuning.setting_for_factor((64, 64), 4) == 8
    assert compressor.tuning.setting_for_factor((64, 64), 16) == 2
    x = torch.randn(64, 64)
    errors = compressor.tuning.errors(x, [2, 4, 8])
    assert errors.dtype == torch.float64 and errors[0] > errors[1] > errors[2] > 0
    assert compressor.tuning.kept_energies("w", x, [8, 4], {}).shape == (2,)
    compressor.set_setting("w", 2)
    with pytest.raises(ValueError, match="bits"):
        compressor.set_setting("w", 5)
    assert compressor.setting("w") == 2
    lgreco = hc.CONTROLLERS["lgreco"].build(hc.QuantizedAllReduce(bits=4, min_numel=0), small=True)
    assert lgreco.wrapped.setting_name == "bits"


def test_values_ride_an_all_to_all_to_every_rank():
    """GraVAC's statistics ride QuantizedAllReduce's first hop (``comm.rounds.carrying``): every
    rank receives their mean over ranks, and each row of the payload arrives unchanged."""
    from hvd_compress.comm.rounds import Collective, Round, carrying
    from hvd_compress.comm.simulated import aggregate

    size = 3
    payloads = [torch.arange(6, dtype=torch.int16).view(size, 2) + 10 * rank for rank in range(size)]
    received = [[] for _ in range(size)]
    rounds = [
        carrying(
            Round(payloads[rank], Collective.ALLTOALL, lambda rows: rows),
            torch.tensor([float(rank), 1.0]),
            received[rank].append,
        )
        for rank in range(size)
    ]
    for rank, (round_, result) in enumerate(zip(rounds, aggregate(rounds))):
        rows = round_.then(result)
        assert torch.equal(rows, torch.stack([payloads[source][rank] for source in range(size)]))
        assert torch.equal(received[rank][0], torch.tensor([1.0, 1.0]))


def fsdp_rows(grads, size):
    """FSDP2's reduce-scatter input of ``grads`` (name -> full gradient, dim 0 sharded): (size,
    m), row j every gradient's rows of rank j, dim 0 zero-padded to a multiple of ``size``."""
    rows = []
    for g in grads.values():
        per_rank = -(-g.shape[0] // size)
        padded = torch.cat([g, g.new_zeros(size * per_rank - g.shape[0], *g.shape[1:])])
        rows.append(padded.reshape(size, -1))
    return torch.cat(rows, dim=1)


@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_scatter_hop_keeps_input_minus_sent_per_parameter(bits):
    """Hop 1 alone on FSDP's layout (fc.weight's 33 rows padded to 36 at W = 4): what it sends
    decodes to the float64 reference's values of input plus residual, and the residual each
    parameter keeps (its full shape) is what quantisation left out."""
    size, shapes = 4, {"fc.weight": (33, 70), "conv.weight": (16, 8, 3, 3)}
    compressor = hc.QuantizedAllReduce(bits=bits, block_size=64)
    layout = list(shapes.items())
    residuals = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for step in range(3):
        grads = gradients(step, 0, shapes)
        x = fsdp_rows({name: g + residuals[name] for name, g in grads.items()}, size)
        m = x.shape[1]
        padded = torch.nn.functional.pad(x.double(), (0, (-m) % absmax.ROW_MULTIPLE))
        values, left_out = quantized64(padded, bits, 64)
        sent = compressor.quantize_reduce_scatter(fsdp_rows(grads, size), layout)
        decoded = compressor.decode_reduce_scatter(sent, m)
        assert torch.allclose(decoded.double(), values[:, :m], rtol=1e-5, atol=1e-5)
        compressor.end_step()
        residuals = {name: compressor.residual(name) for name in shapes}
        assert torch.allclose(fsdp_rows(residuals, size).double(), left_out[:, :m], atol=1e-5)
        assert torch.equal(fsdp_rows(residuals, size), x - decoded)
    with pytest.raises(ValueError, match="rows hold"):
        compressor.quantize_reduce_scatter(fsdp_rows(grads, size), layout[:1])
