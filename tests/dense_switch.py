"""Which registered compressors can send a layer whole, and at which setting: shared by the
unit tests (tests/unit/test_compressors.py) and the multi-rank tier (tests/multirank/helpers.py)."""

from typing import Any, List, Tuple

import hvd_compress as hc


def sends_whole(compressor: Any, shape: Tuple[int, ...]) -> Any:
    """A setting at which ``compressor`` sends a tunable gradient of ``shape`` uncompressed
    (the one that would compress it 1x), or None where every setting compresses it."""
    setting = compressor.tuning.setting_for_factor(shape, 1.0)
    return None if compressor.tuning.compresses(shape, setting) else setting


def dense_switchable(shape: Tuple[int, ...]) -> List[str]:
    """The registered controllable compressors whose settings can send a layer of ``shape`` whole."""
    return [
        name
        for name in hc.registry.controllable()
        if sends_whole(hc.COMPRESSORS[name].build(small=True), shape) is not None
    ]
