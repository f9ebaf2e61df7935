"""`governor bench-device`: a real engine child measured per setting; its TOML is the device model's prior."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from govbase.errors import GovernorError
from governor.benchdevice import prior_of
from policies import StateMachine, load_policy
from policies.devicefile import Measured, load_device_model
from policies.schema import Power


@pytest.mark.slow
def test_measures_the_small_tier_and_writes_a_prior_the_policy_loads(demo_ladder: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "device.toml", tmp_path / "device.png"
    argv = [
        sys.executable, "-m", "governor", "bench-device", "--models", str(demo_ladder), "--tiers", "small",
        "--kv", "f16,q8_0", "--threads", "1,2", "--fill", "0,64", "--tokens", "8", "--ctx", "256",
        "--root", str(tmp_path / "no-sysfs"), "--state-dir", str(tmp_path), "--out", str(out), "--plot", str(png),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bench-device" in done.stdout
    assert "q8_0" in done.stdout
    prior = load_device_model(out)
    assert prior.thread_tok_s is not None
    assert prior.thread_tok_s > 0
    assert out.read_text().count("[[run]]") == 2 * 2 * 2  # KV types x threads x fills (clock not writable here)
    assert png.stat().st_size > 1000
    gov = StateMachine(load_policy("default"), prior=prior)
    assert gov.power.model.a == prior.thread_tok_s


def test_a_wrong_device_file_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "device.toml"
    bad.write_text("[power]\nthread_tok_s = -3\n")
    with pytest.raises(GovernorError, match=r"device.toml: power.thread_tok_s: .*greater than 0"):
        load_device_model(bad)
    bad.write_text("[power]\nthread_toks = 3\n")
    with pytest.raises(GovernorError, match=r"power.thread_toks: Extra inputs are not permitted"):
        load_device_model(bad)


def test_a_prior_out_of_range_is_refused_before_it_is_written() -> None:
    """A stream timed by its chunks once gave 337,674 tok/s per thread: written, then refused by the loader."""
    run = Measured(
        tier="small", kv_type="f16", threads=1, freq_ratio=1.0, ctx_fill=0, tokens_per_s=337674.868, ttft_s=0, rss_mb=1
    )
    with pytest.raises(GovernorError, match=r"measured 337675 tok/s per thread: .*less than or equal to 100000"):
        prior_of([run], Power())
    assert prior_of([run.model_copy(update={"tokens_per_s": 120.6})], Power()).thread_tok_s == 120.6
