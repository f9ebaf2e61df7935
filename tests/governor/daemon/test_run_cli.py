"""`governor run`'s start-up: bad input is one line and exit 2; with no models it uses the demo ladder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from governor.daemon.app import ladder_path
from governor.daemon.config import load_config
from policies.ladder import load_ladder


def run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "governor", "run", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_a_bad_policy_at_start_is_one_line(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text("[timing]\ninterval_s = -1\n")
    done = run(
        "--policy", str(policy), "--models", str(demo_ladder), "--state-dir", str(tmp_path / "s"),
        "--control-socket", str(sock_dir / "c.sock"), "--engine-socket", str(sock_dir / "e.sock"), "--no-udev",
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"governor: error: {policy}")
    assert "interval_s" in line
    assert not (sock_dir / "c.sock").exists()


def test_a_typo_in_the_config_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "governor.toml"
    config.write_text('polcy = "default"\n')
    done = run("--config", str(config))
    assert done.returncode == 2
    assert done.stderr.strip() == f"governor: error: {config}:1: polcy: Extra inputs are not permitted"


def test_without_models_the_demo_ladder_is_used(tmp_path: Path, real_ladder: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "demo-models").symlink_to(real_ladder.parent)  # already written: the child only checks
    config = load_config(None, {"state_dir": tmp_path / "state"}, env={}, euid=1000)
    assert config.models is None
    path = ladder_path(config)
    assert path == tmp_path / "state" / "demo-models" / "ladder.toml"
    assert [t.name for t in load_ladder(path).tiers] == ["large", "medium", "small"]
