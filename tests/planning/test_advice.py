"""Advice on settings and results: default depth, flagged cuts, calibration size, which number to trust."""

from __future__ import annotations

from ghosted_core.planning.advice import calibration_advice, cut_advice, default_depth, disagreements, \
    worse_than_pruning


def test_the_default_depth_is_a_quarter_of_the_blocks_and_always_leaves_some():
    assert [default_depth(n) for n in (30, 18, 24, 32, 2)] == [7, 4, 6, 8, 1]
    assert all(1 <= default_depth(n) < n for n in range(2, 100))


def test_deep_cuts_and_cuts_through_the_last_block_are_flagged_as_severe():
    assert cut_advice(30, 12) == []  # 40% exactly is not more than 40%
    deep = cut_advice(30, 13)
    assert len(deep) == 1 and deep[0].severe and "13 of 30 blocks (43%)" in deep[0].message
    last = cut_advice(18, 7, range(11, 18))
    assert len(last) == 1 and last[0].severe and "reaches the last block (17)" in last[0].message
    assert cut_advice(18, 7, range(10, 17)) == []  # 39%, ending before the last block


def test_calibration_below_four_and_two_tokens_per_channel_is_flagged():
    width = 576
    assert calibration_advice(4 * width, width, ["ghost"]) == []
    mild = calibration_advice(4 * width - 1, width, ["none", "ghost"])
    assert len(mild) == 1 and not mild[0].severe and "4·C = 2304" in mild[0].message and "(ghost)" in mild[0].message
    severe = calibration_advice(2 * width - 1, width, ["ghost_capped", "replaceme+seq", "diag"])
    assert len(severe) == 1 and severe[0].severe and "(ghost_capped, replaceme+seq)" in severe[0].message
    assert calibration_advice(10, width, ["none", "diag", "rotate"]) == []  # nothing is solved by least squares


def test_operators_are_marked_worse_than_pruning_only_above_one():
    assert worse_than_pruning(1.01) and not worse_than_pruning(1.0) and not worse_than_pruning(None)


def test_disagreement_is_boundary_error_and_perplexity_ranking_an_operator_differently_against_pruning():
    perplexity = {"ptb": {"dense": 10.0, "none": 30.0, "ghost": 40.0, "diag": 25.0, "rotate": 20.0},
                  "wiki": {"dense": 5.0, "none": 9.0, "ghost": 8.0, "diag": 8.0, "rotate": 7.0}}
    errors = {"none": [1.0], "ghost": [0.5],  # error says better, ptb perplexity says worse
              "diag": [1.2, 0.9],  # error says worse at one cut, perplexity says better everywhere
              "rotate": [0.8]}  # both say better
    assert disagreements(perplexity, errors) == ["ghost", "diag"]
    assert disagreements({}, errors) == []  # no perplexity yet: nothing to compare
