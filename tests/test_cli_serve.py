"""`agentrt serve` options reach the engine (uvicorn is replaced: nothing listens), and bad ones exit 2."""

import uvicorn

from agentrt.cli import main


def test_kv_storage_and_method_reach_the_engine(tiny_dirs, monkeypatch, tmp_path):
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append((app, kw)))
    import agentrt.app as app_module

    engines = []
    build = app_module.build_engine
    monkeypatch.setattr(app_module, "build_engine", lambda config: engines.append(build(config)) or engines[-1])
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


def test_bad_serve_options_exit_2(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("served")))
    base = ["serve", "--model", str(tiny_dirs["llama"]), "--no-auth", "--device", "cpu"]
    assert main(base + ["--kv-storage", "no-such-codec"]) == 2
    assert "no-such-codec" in capsys.readouterr().err
    assert main(base + ["--kv-storage", "fp8", "--kv-storage-config", "[1]"]) == 2
    assert "--kv-storage-config must be a JSON object" in capsys.readouterr().err
    assert main(base + ["--method-config", "{nope"]) == 2
    assert "--method-config is not JSON" in capsys.readouterr().err
    assert main(base + ["--decode-steps", "0"]) == 2
    assert "decode_steps must be a positive int" in capsys.readouterr().err
