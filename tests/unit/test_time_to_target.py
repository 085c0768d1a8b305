"""Time to target's choice of what to time, without a testbed."""

import pytest

from benchmarks import time_to_quality as ttq
from benchmarks import time_to_target as ttt


def test_methods_narrow_the_timed_labels_and_keep_uncompressed():
    methods = {ttq.UNCOMPRESSED: {}, "FP16": {}, "GraVAC (Top-K), epsilon 0.7": {}, "QSGD bits 8": {}}
    assert ttt.chosen_methods(methods, None) is methods
    chosen = ttt.chosen_methods(methods, ["GraVAC (Top-K), epsilon 0.7"])
    assert list(chosen) == [ttq.UNCOMPRESSED, "GraVAC (Top-K), epsilon 0.7"]
    with pytest.raises(SystemExit, match=r"--methods \['FP32'\] are not priced methods"):
        ttt.chosen_methods(methods, ["FP32"])
    args = ttt.parse_args(["--ratios", "30", "--methods", "FP16; GraVAC (Top-K), epsilon 0.7"])
    assert args.methods == ["FP16", "GraVAC (Top-K), epsilon 0.7"] and args.ratios == [30.0]


def test_between_sites_the_soonest_local_method_is_set_against_uncompressed_and_per_step():
    def method(kind=None, seeds=3):
        return {"spec": {"controller": {"kind": kind} if kind else None}, "score": {"seeds": seeds}}

    methods = {
        ttq.UNCOMPRESSED: method(),
        "Top-K density 0.01": method(),
        "Streaming DiLoCo": method("streaming", seeds=1),
        "DiLoCo H=50": method("diloco"),
    }
    seconds = {ttq.UNCOMPRESSED: 6000.0, "Top-K density 0.01": 600.0, "Streaming DiLoCo": 400.0, "DiLoCo H=50": 2500.0}
    lines = ttt.between_sites_targets(seconds, methods, seconds[ttq.UNCOMPRESSED])
    assert "(Streaming DiLoCo, 400.0 s, steps from 1 seed(s)) >= 3x sooner than uncompressed: met (15.00x)" in lines[0]
    assert lines[1].endswith("(Top-K density 0.01, 600.0 s): met (1.50x).")
    seconds["Streaming DiLoCo"] = 2100.0
    lines = ttt.between_sites_targets(seconds, methods, seconds[ttq.UNCOMPRESSED])
    assert "missed (2.86x)" in lines[0] and "missed (0.29x)" in lines[1]
    assert "no local method" in ttt.between_sites_targets({ttq.UNCOMPRESSED: 1.0}, methods, 1.0)[0]


def test_the_local_pick_is_read_from_advise_across_sites_line():
    line = (
        "across sites: streaming/qsgd H=50,F=2,delay=5,mixing=0.5,bits=4 is projected to reach uncompressed's "
        "quality in 0.05x its time, sending 0.0043 MB a step (...)"
    )
    assert ttt.across_sites_pick(
        line + "; sooner than the per-step topk density=0.01 (0.11x), the soonest per-step"
    ) == (
        "streaming/qsgd",
        "H=50,F=2,delay=5,mixing=0.5,bits=4",
    )
    assert (
        ttt.across_sites_pick(line + "; the per-step topk density=0.01 is sooner here (0.03x): train with it") is None
    )
    assert ttt.across_sites_pick("across sites: no local setting measured here reached ...") is None
