"""The schedule descriptions: torch's own orders of actions give the textbook bubbles and in-flight counts, and the
config refuses layouts a schedule cannot run, naming the setting."""
from __future__ import annotations

import pytest

from diffpipe.config import ConfigError
from diffpipe.config_files import build_config
from diffpipe.pipeline.schedules import SCHEDULES, ideal_bubble, in_flight


@pytest.mark.parametrize("ranks,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_ideal_bubbles_are_the_textbook_ones(ranks, m):
    fill = ranks - 1
    assert ideal_bubble("gpipe", ranks, m) == pytest.approx(fill / (m + fill))
    assert ideal_bubble("1f1b", ranks, m) == pytest.approx(fill / (m + fill))
    assert ideal_bubble("interleaved_1f1b", ranks, m, 2) == pytest.approx(fill / (2 * m + fill))
    # ZB-H1 (Qi et al. 2024) with F = I = W: a third of 1F1B's fill, interleaved over 2 chunks
    assert ideal_bubble("zb1p", ranks, m, 2) == pytest.approx(fill / (3 * 2 * m + fill))
    for name in ("zbv", "dualpipev"):
        assert ideal_bubble(name, ranks, m, 2) < ideal_bubble("interleaved_1f1b", ranks, m, 2)
    assert ideal_bubble("1f1b", 1, m) == 0.0


def test_in_flight_micro_batches_follow_the_order_of_actions():
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]  # stages - s
    # V-shaped: rank 0 holds the first and the last stage; the first keeps the most in flight
    zbv = [in_flight("zbv", s, 2, 8, 2) for s in range(4)]
    assert zbv[0] == max(zbv) and zbv[3] == 1


def test_v_shaped_schedules_place_stages_in_a_v():
    zbv = SCHEDULES["zbv"]
    assert [zbv.stage_indices(r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(zbv.rank_of(s, 4) == r for r in range(4) for s in zbv.stage_indices(r, 4))
    assert SCHEDULES["zb1p"].stage_indices(1, 4, 2) == [1, 5]


def _pipeline(**kw) -> dict:
    return {"model": {"preset": "digits"}, "data": {"dataset": "digits"}, "train": {"batch_size": 16},
            "pipeline": {"stages": 2, "microbatches": 4, **kw}}


@pytest.mark.parametrize("kw,words", [
    ({"schedule": "zbv"}, "exactly 2 stages on each process"),
    ({"schedule": "zb1p", "virtual_stages": 1}, "virtual_stages >= 2"),
    ({"schedule": "dualpipev", "virtual_stages": 2, "microbatches": 2}, "microbatches >= its 4 stages"),
    ({"schedule": "1f1b", "virtual_stages": 2}, "set pipeline.virtual_stages = 1"),
    ({"schedule": "zbv", "virtual_stages": 2, "compile": "blocks"}, "set pipeline.compile = false"),
])
def test_impossible_schedule_layouts_are_refused_naming_the_setting(kw, words):
    with pytest.raises(ConfigError, match=words):
        build_config(_pipeline(**kw))


def test_micro_batches_awaiting_their_weight_pass_follow_the_order_of_actions():
    from diffpipe.pipeline.schedules import awaiting_weights
    assert [awaiting_weights("1f1b", s, 2, 8) for s in range(2)] == [0, 0]  # a whole backward
    # zbv, 4 micro-batches, rank 1 ends: I1.2 I2.3 I1.3 W1.2 W2.3 W1.3
    assert [awaiting_weights("zbv", s, 2, 4, 2) for s in (1, 2)] == [2, 1]
    assert all(awaiting_weights("zbv", s, 2, 4, 2) <= in_flight("zbv", s, 2, 4, 2) for s in range(4))
