"""`agentrt demo`, the README's main job: the scripted session runs end to end on the embedded model."""

from agentrt import demo


def test_demo_session_resumes_every_turn_and_its_policy_prunes(capsys):
    rows = demo.run()
    assert [r.turn for r in rows] == list(range(8))
    assert rows[0].status == "created" and all(r.status == "resumed" for r in rows[1:])
    for r in rows[1:]:  # every later turn prefills only what it appended (+1: the last generated token)
        assert r.prefilled == r.appended + 1
    for before, after in zip(rows, rows[1:]):
        assert after.resumed >= before.resumed + before.appended
    # lag 2: the turn that appends tool round k prunes round k - 2 (rounds 0..3 arrive in turns 1..4)
    assert [r.pruned > 0 for r in rows] == [False, False, False, True, True, False, False, False]
    assert rows[3].pages - rows[2].pages < rows[3].prefilled // 16  # the pruned round's pages came back
    assert [r.reply for r in rows[:4]] == [f"call get_weather({c})" for c in demo.CITIES]
    out = capsys.readouterr().out
    assert "2 of 4 rounds pruned" in out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["turn", "status"])
    assert out.index(header) < out.index(demo.LEGEND)  # the legend is printed under the table
    explained = {line.split()[0] for line in demo.LEGEND.splitlines() if line[:2] == "  " and line[2] != " "}
    assert explained == set(header.split()) - {"turn"}  # a line for every column but the turn number
    assert "new + 1" in demo.LEGEND and "scripted" in demo.LEGEND
