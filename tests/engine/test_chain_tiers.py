"""Idle chains in host memory and on disk (engine.chain_tiers): a chain reclaimed under pressure moves down and
its next turn loads it back, byte-identical, for every representation; a full host tier spills to disk, a full
disk tier drops its oldest (recomputed), and a corrupted or partial file is never loaded.

The reference for a loaded chain is the same engine configuration without tiers whose chain never left the
device (a pool large enough): tokens and logprobs of the next turn must be equal."""

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from tests.chain_helpers import random_tokens, run_chain_turn

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)
CASES = {  # name: (arch, options)
    "dense": ("qwen3", {}),
    "compacted": ("llama", {"method": "snapkv", "method_config": {"budget": 16, "window": 4}}),
    "fp8": ("qwen3", {"kv_storage": "fp8"}),
    "latent": ("deepseek_v3", {}),
    "latent-fp8": ("glm4_moe_lite", {"kv_storage": "fp8"}),
    "latent-fp8-compacted": ("deepseek_v3", {"kv_storage": "fp8", "method": "snapkv",
                                             "method_config": {"budget": 16, "window": 4}}),
    "hybrid": ("qwen3_next", {}),
}


def engine(model_dir, num_pages, **options):
    eng = LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", page_size=PAGE, num_pages=num_pages,
                                 max_num_batched_tokens=64, **options))
    if eng.chains.tiers is not None:
        # a turn always reads its chain's file: whether to recompute instead weighs the rates measured so far
        # (a tiny model's file read against its prefill, on a machine busy with other tests), which
        # tests/engine/test_tier_cost.py covers; these tests are about where entries go
        eng.chains.tiers.cost_aware = False
    return eng


def table_bytes(eng, table):
    index = torch.tensor(table.pages)
    return [t.index_select(dim, index).clone() for t, dim in eng.cache.storage.page_tensors()]


def turns(eng, histories, rng, sizes=(12, 30)):
    """One more turn on every chain; returns their outputs."""
    outs = {}
    for cid in histories:
        prompt = histories[cid] + random_tokens(rng, rng.choice(sizes))
        outs[cid] = run_chain_turn(eng, cid, prompt, PARAMS)
        histories[cid] = prompt + outs[cid].token_ids
    return outs


@pytest.mark.parametrize("case", list(CASES))
def test_an_offloaded_chain_loads_back_byte_identical_and_its_next_turn_equals_one_that_never_left(case, tiny_dirs):
    arch, options = CASES[case]
    ref = engine(tiny_dirs[arch], 400, **options)
    eng = engine(tiny_dirs[arch], 40, chain_host_bytes=64 * 2**20, **options)
    rng_ref, rng = random.Random(1), random.Random(1)
    hist_ref = {c: random_tokens(rng_ref, 40) for c in ("a", "b")}
    hist = {c: random_tokens(rng, 40) for c in ("a", "b")}
    turns(ref, hist_ref, rng_ref)
    turns(eng, hist, rng)
    a = eng.chains.index.get("a")
    before = table_bytes(eng, a.table)
    layout = (a.table.num_slots, a.table.layer_lens, a.table.compacted_at)
    state = None if a.table.state is None else [x.clone() for x in (a.table.state.conv, a.table.state.recurrent)]
    eng.chains.memory.reclaim(eng.pool.num_pages)  # pressure: every idle chain moves to the host tier
    assert a.table is None and eng.chain_info("a").status == "host" and eng.pool.num_free == eng.pool.num_pages
    assert eng.chains.memory.load(a)  # what a turn does first
    assert all(torch.equal(x, y) for x, y in zip(before, table_bytes(eng, a.table)))
    assert (a.table.num_slots, a.table.layer_lens, a.table.compacted_at) == layout
    if state is not None:
        assert torch.equal(a.table.state.conv, state[0]) and torch.equal(a.table.state.recurrent, state[1])
    eng.chains.memory.reclaim(eng.pool.num_pages)
    outs_ref, outs = turns(ref, hist_ref, rng_ref), turns(eng, hist, rng)
    for cid in hist:
        assert outs[cid].resume_status == "loaded" and outs_ref[cid].resume_status == "resumed"
        assert outs[cid].token_ids == outs_ref[cid].token_ids
        assert outs[cid].logprobs == outs_ref[cid].logprobs
        assert outs[cid].num_prefilled_tokens == outs_ref[cid].num_prefilled_tokens
    counters = eng.chains.tiers.counters
    assert counters.loads["host"] == 3 and counters.offloaded_tokens > 0 and counters.failed_loads == 0
    for cid in hist:
        eng.delete_chain(cid)
    assert eng.pool.num_free == eng.pool.num_pages and eng.chains.tiers.host_used == 0


def test_a_full_host_tier_spills_to_disk_and_a_full_disk_drops_the_oldest(tiny_dirs, tmp_path):
    model_dir = tiny_dirs["qwen3"]
    rng = random.Random(2)
    hist = {f"c{i}": random_tokens(rng, 40) for i in range(4)}
    hist_ref = {c: list(h) for c, h in hist.items()}
    eng = engine(model_dir, 400, chain_host_bytes=1, chain_disk_dir=str(tmp_path), chain_disk_bytes=1)
    ref = engine(model_dir, 400)
    turns(eng, hist, random.Random(3), sizes=(5,))
    turns(ref, hist_ref, random.Random(3), sizes=(5,))
    one = sum(t.numel() * t.element_size() for t in table_bytes(eng, eng.chains.index.get("c0").table))
    tiers = eng.chains.tiers
    tiers.host_bytes, tiers.disk_bytes = one + one // 2, 2 * one + one // 2  # the host holds one, the disk two
    for cid in hist:  # oldest first, as the scheduler's LRU reclaims them
        state = eng.chains.index.get(cid)
        entry = tiers.offload(cid, state.table)
        eng.cache.release_table(state.table)
        state.table, state.offloaded = None, entry
    where = {cid: eng.chain_info(cid).status for cid in hist}
    assert where == {"c0": "reclaimed", "c1": "disk", "c2": "disk", "c3": "host"}, where
    tiers.flush()  # the files are written on the writer thread
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and not list(tmp_path.glob("*.tmp"))
    outs = turns(eng, hist, random.Random(4), sizes=(5,))
    outs_ref = turns(ref, hist_ref, random.Random(4), sizes=(5,))
    assert {c: o.resume_status for c, o in outs.items()} == {"c0": "recomputed", "c1": "loaded", "c2": "loaded",
                                                             "c3": "loaded"}
    assert all(outs[c].token_ids == outs_ref[c].token_ids for c in hist)
    assert eng.chains.tiers.counters.loads == {"host": 1, "disk": 2}


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "partial"])
def test_a_damaged_file_is_never_loaded_the_chain_recomputes(tiny_dirs, tmp_path, damage, caplog):
    model_dir = tiny_dirs["qwen3"]
    eng = engine(model_dir, 400, chain_host_bytes=1, chain_disk_dir=str(tmp_path), chain_disk_bytes=64 * 2**20)
    ref = engine(model_dir, 400)
    hist, hist_ref = {"c": random_tokens(random.Random(5), 40)}, None
    hist_ref = {"c": list(hist["c"])}
    turns(eng, hist, random.Random(6))
    turns(ref, hist_ref, random.Random(6))
    state = eng.chains.index.get("c")
    tiers = eng.chains.tiers
    tiers.host_bytes = 64 * 2**20
    entry = tiers.offload("c", state.table)
    eng.cache.release_table(state.table)
    state.table, state.offloaded = None, entry
    assert tiers._spill(entry, wait=True)  # noqa: SLF001 -- host -> disk, as a full host tier does
    (path,) = tmp_path.glob("*.safetensors")
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupted":
        path.write_bytes(data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    else:  # a crash mid-write leaves only the temporary file, which the next start removes
        path.rename(path.with_suffix(".tmp"))
        ChainTiersRestart = type(tiers)
        ChainTiersRestart(eng.cache, 1, tmp_path, 64 * 2**20)
        assert not list(tmp_path.glob("*.tmp"))
    outs, outs_ref = turns(eng, hist, random.Random(7)), turns(ref, hist_ref, random.Random(7))
    assert outs["c"].resume_status == "recomputed" and outs["c"].token_ids == outs_ref["c"].token_ids
    if damage != "partial":
        assert tiers.counters.failed_loads == 1 and "could not be read" in caplog.text


def test_bad_tier_settings_are_config_errors(tiny_dirs, tmp_path):
    with pytest.raises(ConfigError, match="chain_host_bytes must be an int >= 0"):
        EngineConfig(tiny_dirs["qwen3"], chain_host_bytes=-1)
    with pytest.raises(ConfigError, match="chain_disk_dir and chain_disk_bytes go together"):
        EngineConfig(tiny_dirs["qwen3"], chain_host_bytes=10, chain_disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="set chain_host_bytes too"):
        EngineConfig(tiny_dirs["qwen3"], chain_disk_dir=str(tmp_path), chain_disk_bytes=10)


def test_under_pressure_the_scheduler_moves_chains_down_and_their_turns_load_them(tiny_dirs):
    """Six chains on a pool that holds about three: the scheduler reclaims idle chains as it admits turns; with a
    host tier their next turns load instead of recomputing, and every turn equals a roomy engine's."""
    model_dir = tiny_dirs["llama"]
    eng, ref = engine(model_dir, 48, chain_host_bytes=64 * 2**20), engine(model_dir, 600)
    rng, rng_ref = random.Random(8), random.Random(8)
    hist = {f"c{i}": random_tokens(rng, 36) for i in range(6)}
    hist_ref = {f"c{i}": random_tokens(rng_ref, 36) for i in range(6)}
    statuses = []
    for _ in range(3):
        outs, outs_ref = turns(eng, hist, rng, sizes=(3, 9)), turns(ref, hist_ref, rng_ref, sizes=(3, 9))
        assert {c: o.token_ids for c, o in outs.items()} == {c: o.token_ids for c, o in outs_ref.items()}
        statuses += [o.resume_status for o in outs.values()]
    assert statuses.count("loaded") >= 6 and "recomputed" not in statuses
    assert eng.chains.tiers.counters.offloaded_tokens > 0


def test_a_restart_adopts_the_chains_written_at_shutdown_and_their_turns_load(tiny_dirs, tmp_path):
    """``persist_chains`` (a server's shutdown) writes the idle chains to the disk tier; an engine started on the
    same directory adopts them and their next turns load (only the new suffix is prefilled) with the tokens a
    process that never stopped produces. Chains whose method keeps state between turns (H2O's accumulated
    scores, SnapKV's stashed window queries) carry it in their files."""
    model_dir = tiny_dirs["qwen3"]
    tiers = dict(chain_host_bytes=64 * 2**20, chain_disk_dir=str(tmp_path), chain_disk_bytes=64 * 2**20)
    methods = {"d": {}, "h2o": dict(method="h2o", method_config={"heavy_budget": 8, "recent_budget": 8}),
               "snap": dict(method="snapkv", method_config={"budget": 16, "window": 4})}
    first, ref = engine(model_dir, 400, **tiers), engine(model_dir, 400)
    hist = {c: random_tokens(random.Random(10 + i), 30) for i, c in enumerate(methods)}
    hist_ref = {c: list(h) for c, h in hist.items()}
    for c, options in methods.items():
        for eng, h in ((first, hist), (ref, hist_ref)):
            prompt = h[c] + random_tokens(random.Random(20), 12)
            out = run_chain_turn(eng, c, prompt, PARAMS, **options)
            h[c] = prompt + out.token_ids
    assert first.chains.index.get("h2o").method_state is not None
    assert first.persist_chains() == 3
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    second = engine(model_dir, 400, **tiers)
    for c in methods:
        info = second.chain_info(c)
        assert info.status == "disk" and info.computed_tokens == len(hist[c]) - 1
    for c, options in methods.items():
        outs = []
        for eng, h in ((second, hist), (ref, hist_ref)):
            prompt = h[c] + random_tokens(random.Random(30), 9)
            outs.append(run_chain_turn(eng, c, prompt, PARAMS, **options))
        got, want = outs
        assert got.resume_status == "loaded" and want.resume_status == "resumed"
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs, c
        assert got.num_prefilled_tokens == want.num_prefilled_tokens


def test_a_chain_whose_method_state_no_file_can_hold_is_not_adopted_after_a_restart(tiny_dirs, tmp_path,
                                                                                       monkeypatch):
    """A method state that is not tensors, lists, dicts and scalars cannot be written: the chain is not written
    at shutdown, and a file spilled under pressure before is flagged and removed at the restart (adopting it
    without its state would resume a different computation); it is recomputed."""
    from policies.h2o import H2O

    class Opaque:
        pass

    monkeypatch.setattr(H2O, "export_state", lambda self, req: Opaque())
    model_dir = tiny_dirs["qwen3"]
    tiers = dict(chain_host_bytes=64 * 2**20, chain_disk_dir=str(tmp_path), chain_disk_bytes=64 * 2**20)
    first = engine(model_dir, 400, **tiers)
    run_chain_turn(first, "h", random_tokens(random.Random(3), 30), PARAMS, method="h2o",
                   method_config={"heavy_budget": 8, "recent_budget": 8})
    assert first.persist_chains() == 0 and not list(tmp_path.glob("*.safetensors"))
    assert first.release_chain("h") and first.chains.tiers.persist_entry(first.chains.index.get("h").offloaded)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # spilled, flagged
    second = engine(model_dir, 400, **tiers)
    assert "h" not in second.chains.index and not list(tmp_path.glob("*.safetensors"))


def test_another_engine_adopts_a_handed_off_chain_replacing_its_older_copy(tiny_dirs, tmp_path):
    """``adopt_chain``: engine B takes over the file engine A wrote at its shutdown (a drained replica's chain),
    replacing the older copy of the chain B held from an earlier turn; its next turn loads the newest state and
    produces what a process that never moved the chain produces. The file moves into B's tier: a second claim
    finds nothing."""
    model_dir = tiny_dirs["qwen3"]
    tiers = dict(chain_host_bytes=64 * 2**20, chain_disk_bytes=64 * 2**20)
    a = engine(model_dir, 400, chain_disk_dir=str(tmp_path / "a"), **tiers)
    b = engine(model_dir, 400, chain_disk_dir=str(tmp_path / "b"), **tiers)
    ref = engine(model_dir, 400)
    hist, hist_ref = {"d": random_tokens(random.Random(30), 30)}, None
    hist_ref = {"d": list(hist["d"])}
    turns(b, dict(hist), random.Random(31))  # B's copy: the chain's first turn only
    turns(a, hist, random.Random(31))
    turns(ref, hist_ref, random.Random(31))
    turns(a, hist, random.Random(32))  # A ran a second turn: its state is the newest
    turns(ref, hist_ref, random.Random(32))
    assert a.persist_chains() == 1
    (path,) = (tmp_path / "a").glob("*.safetensors")
    assert b.adopt_chain(str(path)) and not path.exists()
    assert not b.adopt_chain(str(path))  # claimed already
    assert b.chain_info("d").status == "disk" and b.chain_info("d").computed_tokens == len(hist["d"]) - 1
    outs, outs_ref = turns(b, hist, random.Random(33)), turns(ref, hist_ref, random.Random(33))
    assert outs["d"].resume_status == "loaded" and outs["d"].token_ids == outs_ref["d"].token_ids
    assert outs["d"].num_prefilled_tokens == outs_ref["d"].num_prefilled_tokens
    assert not engine(model_dir, 400).adopt_chain(str(path))  # no disk tier: nothing to adopt into


def test_session_hints_pin_release_prefetch_priority_and_ttl(tiny_dirs):
    model_dir = tiny_dirs["qwen3"]
    eng = engine(model_dir, 400, chain_host_bytes=64 * 2**20)
    ref = engine(model_dir, 400)
    rng, rng_ref = random.Random(20), random.Random(20)
    hist = {c: random_tokens(rng, 30) for c in ("a", "b", "c")}
    hist_ref = {c: random_tokens(rng_ref, 30) for c in ("a", "b", "c")}
    turns(eng, hist, rng)
    turns(ref, hist_ref, rng_ref)
    # release: off the device at once (to the host tier); prefetch: back before the turn, which then resumes
    assert eng.release_chain("a") and eng.chain_info("a").status == "host"
    assert eng.prefetch_chain("a") and eng.chain_info("a").status == "idle"
    # pin: never moved, not by release and not by pressure; priority: lower ones leave first
    eng.pin_chain("b")
    with pytest.raises(Exception, match="pinned"):
        eng.release_chain("b")
    eng.chain_hints("a", priority=5)
    pages = eng.chain_info("c").pages_held
    eng.chains.memory.reclaim(eng.pool.num_free + pages)  # room for one more chain's pages: "c" (priority 0) goes
    assert [eng.chain_info(c).status for c in "abc"] == ["idle", "idle", "host"]
    outs, outs_ref = turns(eng, hist, rng), turns(ref, hist_ref, rng_ref)
    assert [outs[c].resume_status for c in "abc"] == ["resumed", "resumed", "loaded"]
    assert all(outs[c].token_ids == outs_ref[c].token_ids for c in "abc")
    # ttl: an idle chain's KV is dropped once it has been idle that long (device and tiers), then recomputed
    eng.chain_hints("a", ttl_s=0.001)
    eng.release_chain("c")
    eng.chain_hints("c", ttl_s=0.001)
    import time

    time.sleep(0.01)
    assert eng.chains.memory.expire(time.monotonic()) == 2
    assert eng.chain_info("a").status == "reclaimed" and eng.chain_info("c").status == "reclaimed"
    assert eng.chains.tiers.host_used == 0
    outs = turns(eng, hist, rng)
    assert outs["a"].resume_status == "recomputed" and outs["b"].resume_status == "resumed"
    with pytest.raises(Exception, match="ttl_s must be > 0"):
        eng.chain_hints("a", ttl_s=0)


# --- writes to disk run on the writer thread ---------------------------------------------------------------------
def _move_down(eng, cid):
    """Offload ``cid`` to the host tier (making room by spilling older chains), as a reclaim does."""
    state = eng.chains.index.get(cid)
    entry = eng.chains.tiers.offload(cid, state.table)
    eng.cache.release_table(state.table)
    state.table, state.offloaded = None, entry


@pytest.fixture
def held_writes(monkeypatch):
    """The writer thread's file writes wait for ``release`` (set()); ``entered`` is set when one starts; records
    the threads that wrote."""
    import threading

    import engine.chain_tiers as chain_tiers

    release, entered, threads, real = threading.Event(), threading.Event(), [], chain_tiers.save_file

    def save_file(*args, **kwargs):
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30), "the test never released the writer"
        return real(*args, **kwargs)

    monkeypatch.setattr(chain_tiers, "save_file", save_file)
    return release, entered, threads


def _tier_engines(tiny_dirs, tmp_path, seed, chains=("c0", "c1", "c2")):
    model_dir = tiny_dirs["qwen3"]
    eng = engine(model_dir, 400, chain_host_bytes=1, chain_disk_dir=str(tmp_path), chain_disk_bytes=64 * 2**20)
    ref = engine(model_dir, 400)
    hist = {c: random_tokens(random.Random(seed), 40) for c in chains}
    hist_ref = {c: list(h) for c, h in hist.items()}
    turns(eng, hist, random.Random(seed + 1), sizes=(5,))
    turns(ref, hist_ref, random.Random(seed + 1), sizes=(5,))
    one = sum(t.numel() * t.element_size() for t in table_bytes(eng, eng.chains.index.get(chains[0]).table))
    eng.chains.tiers.host_bytes = one + one // 2  # the host tier holds one chain
    return eng, ref, hist, hist_ref


def test_a_spill_returns_before_its_file_is_written_and_a_turn_meanwhile_loads_the_host_copy(
        tiny_dirs, tmp_path, held_writes):
    import threading

    release, entered, threads = held_writes
    eng, ref, hist, hist_ref = _tier_engines(tiny_dirs, tmp_path, 40)
    tiers = eng.chains.tiers
    _move_down(eng, "c0")
    _move_down(eng, "c1")  # c0 spills: the engine thread goes on while the writer waits
    assert entered.wait(10)
    assert threads == ["chain-tier-writer_0"] and threading.current_thread().name not in threads
    assert eng.chain_info("c0").status == "disk" and not list(tmp_path.glob("*.safetensors"))
    assert tiers.host_used <= tiers.host_bytes and tiers.disk_used > 0
    outs = turns(eng, {"c0": hist["c0"]}, random.Random(41), sizes=(5,))  # loads the copy still in memory
    outs_ref = turns(ref, {"c0": hist_ref["c0"]}, random.Random(41), sizes=(5,))
    assert outs["c0"].resume_status == "loaded" and outs["c0"].token_ids == outs_ref["c0"].token_ids
    assert outs["c0"].logprobs == outs_ref["c0"].logprobs
    release.set()
    tiers.flush()
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.tmp"))  # the loaded copy's file
    assert tiers.disk_used == 0 and tiers.counters.seconds["spill"] > 0
    _move_down(eng, "c2")  # c1 spills and is written; its turn reads the file
    tiers.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    outs = turns(eng, {"c1": hist["c1"]}, random.Random(42), sizes=(5,))
    outs_ref = turns(ref, {"c1": hist_ref["c1"]}, random.Random(42), sizes=(5,))
    assert outs["c1"].resume_status == "loaded" and outs["c1"].token_ids == outs_ref["c1"].token_ids
    assert tiers.counters.loads == {"host": 0, "disk": 2}


def test_host_memory_held_by_writes_in_flight_stays_within_the_host_tier(tiny_dirs, tmp_path, held_writes):
    """A second spill while the first chain's file is still being written waits for it: the copies held for
    writes never exceed the host tier's size."""
    import threading

    release, _, _ = held_writes
    eng, _, _, _ = _tier_engines(tiny_dirs, tmp_path, 50)
    tiers = eng.chains.tiers
    _move_down(eng, "c0")
    _move_down(eng, "c1")  # c0's write is held
    first = tiers.entries["c0"].writing
    timer = threading.Timer(0.3, release.set)
    timer.start()
    _move_down(eng, "c2")  # c1 spills: it waits for c0's write, which the timer releases
    assert first.done()
    tiers.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_a_failed_write_drops_the_chain_which_recomputes(tiny_dirs, tmp_path, monkeypatch, caplog):
    import engine.chain_tiers as chain_tiers

    def full_disk(tensors, filename, metadata=None):
        open(filename, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    eng, ref, hist, hist_ref = _tier_engines(tiny_dirs, tmp_path, 60)
    monkeypatch.setattr(chain_tiers, "save_file", full_disk)
    _move_down(eng, "c0")
    _move_down(eng, "c1")
    eng.chains.tiers.flush()
    assert eng.chain_info("c0").status == "reclaimed" and eng.chains.tiers.counters.failed_writes == 1
    assert not list(tmp_path.iterdir()) and "could not be written" in caplog.text
    outs = turns(eng, {"c0": hist["c0"]}, random.Random(61), sizes=(5,))
    outs_ref = turns(ref, {"c0": hist_ref["c0"]}, random.Random(61), sizes=(5,))
    assert outs["c0"].resume_status == "recomputed" and outs["c0"].token_ids == outs_ref["c0"].token_ids


def test_shutdown_writes_pinned_chains_and_those_in_the_host_tier(tiny_dirs, tmp_path):
    model_dir = tiny_dirs["qwen3"]
    tiers = dict(chain_host_bytes=64 * 2**20, chain_disk_dir=str(tmp_path), chain_disk_bytes=64 * 2**20)
    first, ref = engine(model_dir, 400, **tiers), engine(model_dir, 400)
    hist = {c: random_tokens(random.Random(70), 30) for c in ("pinned", "host", "device")}
    hist_ref = {c: list(h) for c, h in hist.items()}
    turns(first, hist, random.Random(71))
    turns(ref, hist_ref, random.Random(71))
    first.pin_chain("pinned")
    assert first.release_chain("host") and first.chain_info("host").status == "host"
    assert first.persist_chains() == 3
    second = engine(model_dir, 400, **tiers)
    assert {c: second.chain_info(c).status for c in hist} == {c: "disk" for c in hist}
    outs, outs_ref = turns(second, hist, random.Random(72)), turns(ref, hist_ref, random.Random(72))
    for c in hist:
        assert outs[c].resume_status == "loaded" and outs[c].token_ids == outs_ref[c].token_ids
