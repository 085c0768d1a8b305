"""Every public constructor refuses a bad argument at once, with a ValueError naming it."""

import math
import re

import pytest
import torch

import hvd_compress as hc

BOOL, NONE, NAN, INF = True, None, math.nan, math.inf
NUMBERS = [BOOL, NONE, NAN, INF, "1", [1]]


def lgreco(**options):
    return hc.LGreCo(hc.PowerSGD(rank=4), transport="local", **options)


def gravac(**options):
    return hc.GraVAC(hc.TopK(density=0.01), **dict(dict(theta_min=10.0), **options))


def lgreco_topk(**options):
    return hc.LGreCo(hc.TopK(density=0.01), transport="local", **options)


def local_method(kind):
    """A constructor of ``kind`` (SparseLoCo, StreamingDiLoCo) over a small model, H = 4."""

    def make(**options):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        return kind(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), inner_steps=4, **options)

    make.__name__ = kind.__name__
    return make


def dense_warmup(**options):
    return hc.DenseWarmup(**dict(dict(compressor=hc.TopK()), **options))


# (constructor, parameter, bad values, what the message names)
TABLE = [
    (hc.PowerSGD, "rank", NUMBERS + [0, -1, 2.5], "rank"),
    (hc.PowerSGD, "min_compression_rate", NUMBERS + [0, -1], "min_compression_rate"),
    (hc.PowerSGD, "start_step", NUMBERS + [-1, 2.5], "start_step"),
    (hc.PowerSGD, "min_numel", NUMBERS + [-1, 2.5], "min_numel"),
    (hc.PowerSGD, "error_feedback", [NONE, 0, "yes"], "error_feedback"),
    (hc.PowerSGD, "warm_start", [NONE, 1, "yes"], "warm_start"),
    (hc.PowerSGD, "seed", [BOOL, NONE, NAN, 1.5, "0"], "seed"),
    (hc.ACPSGD, "rank", NUMBERS + [0, -3], "rank"),
    (hc.TopK, "density", NUMBERS + [0, -0.1, 1.5], "density"),
    (hc.TopK, "error_feedback", [NONE, 1], "error_feedback"),
    (hc.ScaleCom, "density", NUMBERS + [0, 2], "density"),
    (hc.ScaleCom, "beta", NUMBERS + [0, -1, 1.5], "beta"),
    (hc.ScaleCom, "chunks", NUMBERS + [0, -1, 2.5], "chunks"),
    (hc.ScaleCom, "warmup_steps", NUMBERS + [-1, 0.5], "warmup_steps"),
    (hc.ChunkedTopK, "density", NUMBERS + [0, -0.1, 1.5], "density"),
    (hc.ChunkedTopK, "chunk", NUMBERS + [0, 2.5, 1 << 16], "chunk"),
    (hc.ChunkedTopK, "bits", NUMBERS + [0, 3, 16, 2.0], "bits"),
    (hc.ChunkedTopK, "feedback_decay", NUMBERS + [-0.1, 1.5], "feedback_decay"),
    (local_method(hc.SparseLoCo), "outer_lr", NUMBERS + [0, -1], "outer_lr"),
    (local_method(hc.SparseLoCo), "feedback_decay", NUMBERS + [-0.1, 1.5], "feedback_decay"),
    (local_method(hc.StreamingDiLoCo), "fragments", NUMBERS + [0, 5, 2.5], "fragments"),
    (local_method(hc.StreamingDiLoCo), "delay", NUMBERS + [-1, 2, 0.5], "delay"),
    (local_method(hc.StreamingDiLoCo), "mixing", NUMBERS + [-0.1, 1, 1.5], "mixing"),
    (dense_warmup, "warmup_steps", NUMBERS + [-1, 2.5], "warmup_steps"),
    (dense_warmup, "dense", ["fc.weight", [3], [NONE]], "dense"),
    (dense_warmup, "compressor", [NONE, "topk", hc.LGreCo(hc.TopK(), transport="local")], "compressor"),
    (hc.QSGD, "bits", NUMBERS + [0, 1, 9, 4.0], "bits"),
    (hc.QSGD, "bucket_size", NUMBERS + [0, -1, 2.5], "bucket_size"),
    (hc.QSGD, "seed", [BOOL, NONE, NAN, 0.5], "seed"),
    (hc.FP16, "min_numel", NUMBERS + [-1], "min_numel"),
    (lgreco, "decide_every", NUMBERS + [0, -1, "weekly"], "decide_every"),
    (lgreco, "warmup_steps", NUMBERS + [-1], "warmup_steps"),
    (lgreco, "start_step", NUMBERS + [-1, 2.5], "start_step"),
    (lgreco, "error_source", [NONE, 1, "residual"], "error_source"),
    (lgreco, "apply_delay", NUMBERS + [0, -1, 1000, "later"], "apply_delay"),
    (lgreco, "accumulate_steps", [BOOL, NAN, INF, "1", [1], 0, -1, 2.5], "accumulate_steps"),
    (lgreco, "time_buckets", NUMBERS + [0], "time_buckets"),
    (lgreco, "discretization", NUMBERS + [0], "discretization"),
    (lgreco, "timeout", NUMBERS + [0, -1], "timeout"),
    (lgreco, "objective", [NONE, 1, "speed"], "objective"),
    (lgreco, "candidates", [[], [0], [BOOL], [NAN], 5, "248"], "candidate"),
    (lgreco_topk, "candidates", [[], [0], [1.5], [NAN], [-0.1]], "candidate"),
    (lgreco, "accordion", [5, "yes"], "accordion"),
    (
        lambda accordion: lgreco(objective="accordion", accordion=accordion),
        "accordion",
        [hc.Accordion(-1, 0), hc.Accordion(4, NAN), hc.Accordion(4, 2, threshold=-1)],
        "accordion",
    ),
    (
        lambda accordion: lgreco_topk(objective="accordion", accordion=accordion),
        "accordion",
        [hc.Accordion(5.0, 2.0), hc.Accordion(0.1, 0)],
        "accordion",
    ),
    (gravac, "theta_min", NUMBERS + [0, 0.5], "theta_min"),
    (gravac, "theta_max", NUMBERS + [5], "theta_max"),
    (gravac, "epsilon", NUMBERS + [0, 1.5], "epsilon"),
    (gravac, "omega", NUMBERS + [-0.1], "omega"),
    (gravac, "window", NUMBERS + [0, 2.5], "window"),
    (gravac, "policy", [NONE, 1, "linear"], "policy"),
    (gravac, "smoothing", [BOOL, NAN, INF, 0, -0.5, 1.5, "0.1"], "smoothing"),
    (gravac, "scale_down_to", [NONE, "max"], "scale_down_to"),
    (hc.GraVACConfig, "smoothing", [0, 2], "smoothing"),
    (lambda config: hc.PowerSGD(config=config), "config", [hc.TopK().config, 4], "config"),
    (lambda config: hc.GraVAC(hc.TopK(), config=config), "config", [hc.TopK().config], "config"),
    (lambda compressor: hc.GraVAC(compressor), "compressor", [hc.FP16(), hc.ScaleCom(), None], "compressor"),
    (lambda compressor: hc.LGreCo(compressor), "compressor", [hc.BF16(), hc.SignSGD(), 4], "compressor"),
    (hc.ScaledFusion, "dense_threshold", [BOOL, NAN, INF, -1, 2.5, "25MB"], "dense_threshold"),
    (hc.ScaledFusion, "scaled", [NONE, 1], "scaled"),
]


def cases():
    for make, parameter, values, named in TABLE:
        for value in values:
            shown = re.sub(r" at 0x[0-9a-f]+", "", repr(value))  # the same id in every process
            yield pytest.param(
                make, parameter, value, named, id=f"{getattr(make, '__name__', 'make')}-{parameter}-{shown}"
            )


@pytest.mark.parametrize("make, parameter, value, named", cases())
def test_bad_argument_is_refused_naming_it(make, parameter, value, named):
    with pytest.raises(ValueError, match=named):
        make(**{parameter: value})


def test_parameters_instead_of_named_parameters_is_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"named_parameters must be \(name, parameter\) pairs"):
        hc.PowerSGD(model.parameters())
    with pytest.raises(ValueError, match="duplicate names"):
        hc.TopK([("w", model.weight), ("w", model.bias)])


def test_fusion_zero_turns_fusion_off_as_in_horovod():
    from hvd_compress.comm.fusion import FusionScheduler

    shapes = {"a": (64, 64), "b": (64, 64), "c": (64,)}
    plan = FusionScheduler(hc.ACPSGD(rank=4, min_numel=0), shapes, hc.ScaledFusion(0)).plan()
    assert [len(bucket.members) for bucket in plan.buckets] == [1, 1, 1]


def test_a_config_object_builds_what_its_keywords_build():
    from hvd_compress.compressors.lowrank import LowRankConfig
    from hvd_compress.control.lgreco import LGreCoConfig

    keywords = hc.PowerSGD(None, 8, seed=3, min_numel=0)
    built = hc.PowerSGD(config=LowRankConfig(default=8, seed=3, min_numel=0))
    assert built.describe() == keywords.describe()
    lgreco_config = LGreCoConfig(decide_every="epoch", steps_per_epoch=7, transport="local")
    assert hc.LGreCo(hc.PowerSGD(), config=lgreco_config).config.decide_every == 7
    assert hc.GraVAC(hc.TopK(), config=hc.GraVACConfig(window=3)).policy.config.window == 3


def test_a_config_and_its_options_together_are_refused():
    from hvd_compress.compressors.lowrank import LowRankConfig

    with pytest.raises(ValueError, match="PowerSGD: pass either config or its options"):
        hc.PowerSGD(config=LowRankConfig(), seed=1)
    with pytest.raises(ValueError, match="GraVAC: pass either config or its options"):
        hc.GraVAC(hc.TopK(), config=hc.GraVACConfig(), window=3)


def test_an_unknown_option_is_named_with_the_options():
    with pytest.raises(TypeError, match="PowerSGD: unexpected keyword argument 'ranks'; the options are"):
        hc.PowerSGD(ranks=4)
    with pytest.raises(TypeError, match="LGreCo: unexpected keyword argument 'every'"):
        hc.LGreCo(hc.PowerSGD(), every=4)
