"""L-GreCo's first decision on a small transformer's real gradients: 100 steps of training on
real text (the standard library's source) with compression in the loop, then the decision must
send fewer bytes than the uniform default at no more than its total error."""

import pytest

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from examples.workloads import charlm

FAMILIES = {
    "PowerSGD rank 8 (range 4-16)": lambda: hc.PowerSGD(rank=8),
    "TopK 1% (range 0.1%-10%)": lambda: hc.TopK(density=0.01),
    "QSGD 4 bits (range 2-8)": lambda: hc.QSGD(bits=4),
}


def compressed_in_the_loop(lgreco):
    """One rank: gradients pass through the compressor before every optimizer step."""
    world = SimulatedWorld([lgreco])

    def make_optimizer(model, optimizer):
        named = list(model.named_parameters())

        def compress_gradients(*_):
            aggregated = world.step([{name: p.grad for name, p in named}])[0]
            for name, p in named:
                p.grad = aggregated[name]

        optimizer.register_step_pre_hook(compress_gradients)
        return optimizer

    return make_optimizer


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_decision_sends_fewer_bytes_within_the_error_budget(family):
    lgreco = hc.LGreCo(FAMILIES[family](), warmup_steps=100, decide_every=100, apply_delay=5, transport="local")
    charlm.train(compressed_in_the_loop(lgreco), steps=106, max_chars=500_000)
    decision = lgreco.decisions[0]
    print(
        f"\n{family}: first decision sends {decision.total_bytes} bytes/step vs "
        f"{decision.uniform_bytes} uniform: {decision.uniform_bytes / decision.total_bytes:.2f}x "
        f"fewer, error {decision.total_error:.4g} <= budget {decision.budget:.4g}"
    )
    assert decision.total_bytes < decision.uniform_bytes
    assert decision.total_error <= decision.budget
