"""The engine's socket handling and its command line, without starting a model."""

from __future__ import annotations

import argparse
import socket
import stat
from pathlib import Path

import pytest

from governor.cli import build_parser, main
from governor.engine.serve import EngineError, bind_unix, initial
from policies.decision import EngineConfig
from tests.native import in_child


@pytest.mark.parametrize("mode", [0o600, 0o660])
def test_socket_gets_the_asked_mode(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "e.sock"
    with bind_unix(path, mode):
        assert stat.S_IMODE(path.stat().st_mode) == mode


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"
    stale = bind_unix(path, 0o600)
    stale.close()  # the file stays, nobody listens: a crashed engine's leftover
    with bind_unix(path, 0o600) as fresh:
        fresh.listen()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))


def test_live_socket_is_not_stolen(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"
    with bind_unix(path, 0o600) as live:
        live.listen()
        with pytest.raises(EngineError, match="another process is serving on it"):
            bind_unix(path, 0o600)


def test_other_file_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(EngineError, match="not a socket"):
        bind_unix(path, 0o600)
    assert path.read_text() == "keep me"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["engine", "--socket", "/tmp/x.sock", *argv])


def initial_of(*argv: str) -> tuple[list[str], EngineConfig]:
    """In the child: a quantized default KV type makes `initial` check the model's head size with llama.cpp."""
    models, settings = initial(parse(*argv))
    return list(models), settings


def test_defaults_come_from_the_tier(demo_ladder: Path) -> None:
    models, settings = in_child(initial_of, "--models", str(demo_ladder), "--tier", "small")
    assert set(models) == {"large", "medium", "small"}
    assert (settings.model, settings.n_ctx, settings.kv_type, settings.max_tokens_per_s) == (
        "small",
        2048,
        "q8_0",
        None,
    )
    assert settings.threads >= 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tier", "huge"], "--tier 'huge': not in"),
        (["--ctx", "4096"], "allows at most 2048"),
        (["--threads", "0"], "--threads 0"),
        (["--ctx", "0"], "--ctx 0"),
        (["--max-tokens-per-s", "0"], "--max-tokens-per-s 0: Input should be greater than or equal to 0.1"),
        (["--max-tokens-per-s", "nan"], "--max-tokens-per-s nan: Input should be a finite number"),
        (["--kv", "q5_1"], "--kv q5_1: Input should be 'f16', 'q8_0' or 'q4_0'"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    demo_ladder: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["engine", "--socket", "/tmp/x.sock", "--models", str(demo_ladder), *argv])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("governor: error: ")
    assert message in err
    assert "\n" not in err


def test_missing_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--socket", str(tmp_path / "s"), "--model", str(tmp_path / "none.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
