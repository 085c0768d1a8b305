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
