"""hvd_compress.DiLoCo through Horovod (``horovodrun``/``mpirun``): the cases of
tests/outer_cases.py, shared with the torchrun launch (tests/ddp/test_ddp_outer.py)."""

import horovod.torch as hvd
import pytest

import outer_cases as cases


def gather(tensor, name):
    return hvd.allgather(tensor.detach().reshape(1, -1), name=name)


@pytest.mark.parametrize("method", cases.COMPRESSIONS)
def test_replicas_identical_after_every_outer_step(method):
    cases.replicas_identical_after_every_outer_step(gather, hvd.rank(), method)


@pytest.mark.parametrize("method", cases.COMPRESSIONS)
def test_degenerate_shapes_travel(method):
    cases.degenerate_shapes_travel(gather, hvd.rank(), method)


def test_outer_step_is_the_reference_outer_optimizer_on_the_mean():
    cases.outer_step_is_the_reference_outer_optimizer_on_the_mean(gather, hvd.rank(), hvd.size())


def test_sparseloco_steps_along_the_mean_of_what_each_rank_sent():
    cases.sparseloco_steps_along_the_mean_of_what_each_rank_sent(gather, hvd.rank(), hvd.size())


def test_streaming_with_one_fragment_is_diloco_bit_for_bit():
    cases.streaming_with_one_fragment_is_diloco_bit_for_bit(gather, hvd.rank())


def test_streaming_fragments_exchange_in_turn_and_keep_the_anchors_identical():
    cases.streaming_fragments_exchange_in_turn_and_keep_the_anchors_identical(gather, hvd.rank())


def test_streaming_nonfinite_fragment_on_one_rank_skips_its_step_everywhere():
    cases.streaming_nonfinite_fragment_on_one_rank_skips_its_step_everywhere(gather, hvd.rank(), hvd.size())


def test_streaming_resume_with_an_exchange_in_flight_is_exact():
    cases.streaming_resume_with_an_exchange_in_flight_is_exact(gather, hvd.rank())


def test_one_inner_step_is_data_parallel_sgd():
    cases.one_inner_step_is_data_parallel_sgd(gather, hvd.rank(), hvd.size())


def test_nonfinite_pseudo_gradient_on_one_rank_skips_the_outer_step_everywhere():
    cases.nonfinite_pseudo_gradient_on_one_rank_skips_the_outer_step_everywhere(gather, hvd.rank(), hvd.size())


def test_gradscaler_overflow_on_one_rank_keeps_the_periods_in_step():
    cases.gradscaler_overflow_on_one_rank_keeps_the_periods_in_step(gather, hvd.rank())


def test_resume_mid_period_is_exact():
    cases.resume_mid_period_is_exact(gather, hvd.rank())


def test_ranks_that_disagree_all_fail():
    cases.ranks_that_disagree_all_fail(hvd.rank())


@pytest.mark.parametrize("method", ["fp16", "none"])
def test_float16_pseudo_gradients_average_where_their_sum_overflows(method):
    cases.float16_pseudo_gradients_average_where_their_sum_overflows(gather, hvd.rank(), hvd.size(), method)
