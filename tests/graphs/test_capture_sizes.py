"""The replay capture-size rule (issue 34) against the oracle's restatement and by hand."""

import pytest

from swa_bench.checks.oracle import replay_capture_size_table
from swa_bench.graphs.capture_sizes import padded_size, replay_capture_sizes


def sizes(window, max_capture_size=512, max_num_seqs=256, max_num_batched_tokens=1 << 20):
    return replay_capture_sizes(window, max_capture_size=max_capture_size,
                                max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens)


def test_steps_by_window_then_by_an_eighth_of_the_interval():
    # W=16: step 16 until the interval is 256 wide (256/8 = 32 > 16), then 32, then 64.
    assert sizes(16, max_capture_size=1024) == [
        16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256,
        288, 320, 352, 384, 416, 448, 480, 512, 576, 640, 704, 768, 832, 896, 960, 1024,
    ]


def test_bound_is_max_num_seqs_times_window_and_the_last_size():
    assert sizes(8, max_num_seqs=3) == [8, 16, 24]
    assert sizes(10, max_capture_size=35) == [10, 20, 30, 35]
    assert sizes(64, max_num_seqs=1) == [64]


@pytest.mark.parametrize("window", [1, 3, 8, 16, 24, 100, 128])
@pytest.mark.parametrize("max_capture_size,max_num_seqs", [(512, 256), (2048, 64), (300, 2)])
def test_matches_the_oracle(window, max_capture_size, max_num_seqs):
    got = sizes(window, max_capture_size, max_num_seqs)
    assert got == replay_capture_size_table(window, max_capture_size, max_num_seqs)
    assert padded_size(got[-1] + 1, got) is None  # larger replay batches run eagerly


def test_sizes_above_max_num_batched_tokens_are_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sizes(16, max_capture_size=1024, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        replay_capture_sizes(16, max_capture_size=512, max_num_seqs=8,
                             max_num_batched_tokens=64, sizes=[16, 128])
    assert replay_capture_sizes(16, max_capture_size=512, max_num_seqs=8,
                                max_num_batched_tokens=128, sizes=[16, 128]) == [16, 128]


def test_bad_explicit_sizes_are_refused():
    with pytest.raises(ValueError, match="strictly increasing"):
        replay_capture_sizes(16, max_capture_size=512, max_num_seqs=8,
                             max_num_batched_tokens=512, sizes=[32, 16])
    with pytest.raises(ValueError, match=">= 1"):
        sizes(0)
