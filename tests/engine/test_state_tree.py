"""engine.state_tree: a method's chain state as tensors plus a JSON skeleton (what a chain file holds)."""

import json

import pytest
import torch

from engine.state_tree import flatten, unflatten


def test_nested_state_round_trips_through_json_and_its_tensors():
    state = {"acc": [torch.rand(2, 5), torch.rand(2, 3)], "positions": (torch.arange(4), None),
             "queries": [(7, torch.rand(3, 4, 8))], "flags": {"done": True, "scale": 0.5, "name": "x"}}
    skeleton, tensors = flatten(state)
    assert len(tensors) == 4
    back = unflatten(json.loads(json.dumps(skeleton)), [t.clone() for t in tensors], "cpu")
    assert type(back["positions"]) is tuple and type(back["queries"][0]) is tuple and back["positions"][1] is None
    assert back["flags"] == state["flags"] and back["queries"][0][0] == 7
    for a, b in zip(tensors, [back["acc"][0], back["acc"][1], back["positions"][0], back["queries"][0][1]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad,match", [(object(), "holding a object"), ({1: torch.zeros(1)}, "keys must be strings"),
                                       ([{"a": {1, 2}}], "holding a set")])
def test_what_no_file_can_hold_is_refused(bad, match):
    with pytest.raises(TypeError, match=match):
        flatten(bad)
