"""The trade-off picture: its Pareto front against a brute-force definition, and its points from run and sweep JSON."""

from __future__ import annotations

import random

import pytest

from ghosted_core.report.tradeoff import Point, pareto_front, tradeoff_figure, tradeoff_points


def point(name: str, ppl: float, decode: float | None, size: int, depth: int = 1) -> Point:
    return Point(name, depth, (), ppl, decode, None if decode is None else 10 * decode, decode, size, size / 100, "stock")


def dominated(p: Point, others: list[Point], gain) -> bool:
    return any(gain(q) >= gain(p) and q.ppl <= p.ppl and (gain(q) > gain(p) or q.ppl < p.ppl) for q in others)


@pytest.mark.parametrize("seed", range(20))
def test_front_is_exactly_the_undominated_points(seed):
    rng = random.Random(seed)
    points = [point(f"v{i}", rng.choice([1, 2, 3, 5, 8]) * rng.random() + 1, rng.choice([0.9, 1.0, 1.1, 1.3]),
                    rng.randint(50, 100)) for i in range(25)]
    for gain in (lambda p: p.decode, lambda p: -p.weight_bytes):
        front = pareto_front(points, gain)
        expected = {p for p in points if not dominated(p, points, gain)}
        # among exact ties (same gain and ppl) one stands for all; none of the front is dominated
        assert all(p in expected for p in front)
        assert {(gain(p), p.ppl) for p in front} == {(gain(p), p.ppl) for p in expected}
        assert [gain(p) for p in front] == sorted((gain(p) for p in front), reverse=True)


def test_points_without_speed_are_left_off_the_speed_front():
    points = [point("a", 5.0, None, 80), point("b", 6.0, 1.2, 70)]
    assert [p.variant for p in pareto_front(points, lambda p: p.decode)] == ["b"]


def gain(weight_bytes: int, decode: float | None) -> dict:
    entry = {"format": "stock", "parameters": weight_bytes // 4, "weight_bytes": weight_bytes, "size_vs_dense": weight_bytes / 1000}
    if decode is not None:
        entry |= {"decode_vs_dense": decode, "prefill_vs_dense": decode, "decode_tokens_per_s": {"median": 20 * decode}}
    return entry


def run_report() -> dict:
    return {"model": "m", "removed_layers": [2, 3], "corpora": {"ptb": {"label": "PTB", "real": True}},
            "gain": {"measured": True, "decode_tokens": 16, "repeats": 3, "measured_on": {"device": "cpu", "threads": 2}},
            "variants": {"dense": {"ppl": {"ptb": 10.0}, "gain": gain(1000, 1.0)},
                         "none": {"ppl": {"ptb": 30.0}, "gain": gain(700, 1.3)},
                         "ghost": {"ppl": {"ptb": 15.0}, "gain": gain(720, 1.2)},
                         "diag": {"ppl": {"ptb": 25.0}, "gain": gain(701, 1.1)}}}


def test_a_run_gives_one_point_per_variant_and_its_front():
    points = tradeoff_points(run_report())
    assert [(p.variant, p.depth) for p in points] == [("dense", 0), ("none", 2), ("ghost", 2), ("diag", 2)]
    assert [p.variant for p in pareto_front(points, lambda p: p.decode)] == ["none", "ghost", "dense"]
    assert [p.variant for p in pareto_front(points, lambda p: -p.weight_bytes)] == ["none", "diag", "ghost", "dense"]
    fig = tradeoff_figure(run_report())
    fronts = [t for t in fig.data if t.name == "Pareto front"]
    assert [list(t.text) for t in fronts] == [["none, n = 2", "ghost, n = 2", "dense"],
                                              ["none, n = 2", "diag, n = 2", "ghost, n = 2", "dense"]]
    ghost = next(t for t in fig.data if t.name == "ghost")
    assert "--total_num_prune 2 --insert_type ghost" in ghost.hovertemplate[0] and "1.20× dense" in ghost.hovertemplate[0]


def test_a_sweep_gives_one_point_per_depth_and_operator():
    report = {"model": "m", "corpora": {"ptb": {"label": "PTB", "real": True}},
              "sweep": {"dense": {"ppl": {"ptb": 10.0}}, "results": [
                  {"n": n, "removed_layers": list(range(n)), "dense_gain": gain(1000, 1.0),
                   "gain": {"measured": True, "decode_tokens": 16, "repeats": 3, "measured_on": {}},
                   "variants": {"none": {"ppl": {"ptb": 10.0 + 10 * n * n}, "gain": gain(1000 - 100 * n, 1 + 0.1 * n)},
                                "ghost": {"ppl": {"ptb": 10.0 + 5 * n}, "gain": gain(1000 - 90 * n, 1 + 0.09 * n)}}}
                  for n in (1, 2, 3)]}}
    points = tradeoff_points(report)
    assert len(points) == 1 + 3 * 2 and points[0].variant == "dense"
    front = pareto_front(points, lambda p: p.decode)
    assert [p.label for p in front] == ["none, n = 3", "ghost, n = 3", "ghost, n = 2", "ghost, n = 1", "dense"]


def test_without_speed_the_size_panel_still_draws():
    report = run_report()
    for entry in report["variants"].values():
        entry["gain"] = gain(entry["gain"]["weight_bytes"], None)
    fig = tradeoff_figure(report)
    assert [len(t.text) for t in fig.data if t.name == "Pareto front"] == [4]
    assert any("speed not measured" in a.text for a in fig.layout.annotations)
