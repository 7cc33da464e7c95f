"""`agentrt serve` options reach the engine (uvicorn is replaced: nothing listens), and bad ones exit 2."""

import pytest
import uvicorn

from agentrt.cli import main


@pytest.fixture
def built(monkeypatch):
    """The engines `agentrt serve` builds, and the (app, kwargs) uvicorn was asked to serve."""
    served, engines = [], []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append((app, kw)))
    import agentrt.app as app_module

    build = app_module.build_engine
    monkeypatch.setattr(app_module, "build_engine", lambda config: engines.append(build(config)) or engines[-1])
    return engines, served


def test_kv_storage_and_method_reach_the_engine(tiny_dirs, built, tmp_path):
    engines, served = built
    code = main(["serve", "--model", str(tiny_dirs["llama"]), "--no-auth", "--device", "cpu",
                 "--db", f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", "--method", "streaming_llm",
                 "--method-config", '{"window": 64}', "--kv-storage", "kivi",
                 "--kv-storage-config", '{"bits": 2, "group_size": 4, "residual": 8}', "--port", "8123",
                 "--decode-steps", "4"])
    assert code == 0 and served and served[0][1]["port"] == 8123
    (engine,) = engines
    assert engine.method.name == "streaming_llm" and engine.method.config.window == 64
    assert engine.codec.name == "kivi" and engine.codec.config.bits == 2
    assert engine.config.decode_steps == 4
    assert engine.config.warmup is None  # the default: warm up on a GPU at one rank


def test_no_warmup_reaches_the_engine(tiny_dirs, built, tmp_path):
    engines, _ = built
    assert main(["serve", "--model", str(tiny_dirs["llama"]), "--no-auth", "--device", "cpu",
                 "--db", f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", "--no-warmup"]) == 0
    assert engines[-1].config.warmup is False and engines[-1].warmup_tokens == 0


def test_kv_pool_flags_size_the_pool(tiny_dirs, built, tmp_path):
    engines, _ = built
    base = ["serve", "--model", str(tiny_dirs["llama"]), "--no-auth", "--device", "cpu",
            "--db", f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"]
    assert main(base + ["--num-pages", "96"]) == 0
    assert engines[-1].pool.num_pages == 96 and engines[-1].config.num_pages == 96
    assert main(base + ["--kv-cache-memory", "1MiB"]) == 0
    engine = engines[-1]
    assert engine.config.kv_cache_memory_bytes == 2**20 and engine.config.num_pages is None
    assert engine.pool.num_pages == 2**20 // engine.cache.spec.bytes_per_page
    assert main(base + ["--kv-cache-memory", "2MB"]) == 0
    assert engines[-1].config.kv_cache_memory_bytes == 2_000_000


def test_host_and_method_limits_reach_the_server_config(tiny_dirs, built, tmp_path):
    from litestar.testing import TestClient

    _, served = built
    base = ["serve", "--model", str(tiny_dirs["llama"]), "--no-auth", "--device", "cpu",
            "--db", f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"]
    assert main(base + ["--allowed-host", "agents.internal", "--max-method-configs-per-tenant", "2"]) == 0
    app = served[-1][0]
    with TestClient(base_url="http://agents.internal", app=app, timeout=60) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"Host": "localhost"}).status_code == 400
        assert client.app.state.config.max_method_configs_per_tenant == 2
    assert main(base) == 0
    with TestClient(base_url="http://localhost:8000", app=served[-1][0], timeout=60) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"Host": "evil.example"}).status_code == 400


@pytest.mark.parametrize("text, size", [("4096", 4096), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30),
                                        ("1.5G", int(1.5 * 2**30)), ("3GB", 3 * 10**9), ("64k", 64 * 1024),
                                        ("10b", 10)])
def test_kv_cache_memory_sizes(text, size):
    from agentrt.cli import byte_size

    assert byte_size(text) == size


def test_bad_serve_options_exit_2(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("served")))
    base = ["serve", "--model", str(tiny_dirs["llama"]), "--no-auth", "--device", "cpu"]
    assert main(base + ["--kv-storage", "no-such-codec"]) == 2
    assert "--kv-storage no-such-codec: no such KV storage" in capsys.readouterr().err
    assert main(base + ["--kv-storage", "kivi", "--kv-storage-config", '{"bits": 3}']) == 2
    assert "--kv-storage-config: kv_storage 'kivi': bits must be 2 or 4" in capsys.readouterr().err
    assert main(base + ["--method", "snapkv", "--method-config", '{"budget": 0}']) == 2
    assert "--method-config: method 'snapkv': budget" in capsys.readouterr().err
    for flags, message in ((["--kv-storage", "fp8", "--kv-storage-config", "[1]"], "--kv-storage-config: expected a JSON object"),
                           (["--method-config", "{nope"], "--method-config: '{nope' is not JSON"),
                           (["--decode-steps", "0"], "--decode-steps: expected an integer >= 1"),
                           (["--num-pages", "4", "--kv-cache-memory", "1GiB"], "not allowed with argument --num-pages"),
                           (["--kv-cache-memory", "lots"], "--kv-cache-memory: expected a size")):
        with pytest.raises(SystemExit) as exit_info:
            main(base + flags)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
