"""The filters the state machine is built from: debounce, forecast, busy window, PI law."""

from __future__ import annotations

import pytest

from policies.controller import PIController
from policies.filters import BusyWindow, Forecast, Trigger


def test_trigger_needs_the_condition_to_hold_for_the_debounce() -> None:
    trig = Trigger(enter_s=2.0, exit_s=5.0)
    assert [trig.update(raw, t) for t, raw in [(0, True), (1, True), (2, True)]] == [False, False, True]
    assert trig.update(False, 3) is True  # going off needs exit_s
    assert trig.pending
    assert trig.update(True, 4) is True  # the blip is forgotten
    assert not trig.pending
    assert [trig.update(False, t) for t in (5, 9, 10)] == [True, True, False]


def test_trigger_with_zero_debounce_follows_at_once() -> None:
    trig = Trigger(enter_s=0.0, exit_s=0.0)
    assert trig.update(True, 0) is True
    assert trig.update(False, 0.1) is False


def test_forecast_extrapolates_a_ramp() -> None:
    fc = Forecast(window_s=20, horizon_s=10, min_points=4, max_rise_c=15)
    for t in range(10):
        fc.add(float(t), 60.0 + 0.5 * t)
    slope = fc.slope()
    assert slope == pytest.approx(0.5)
    assert fc.predict(64.5, slope) == pytest.approx(69.5)


def test_forecast_is_exact_at_large_monotonic_times_and_after_many_ticks() -> None:
    fc = Forecast(window_s=20, horizon_s=10, min_points=4, max_rise_c=15)
    start = 1_234_567.0  # a monotonic clock after two weeks of uptime
    for i in range(2000):  # several re-bases of the running sums
        t = start + 0.25 * i
        fc.add(t, 60.0 + 0.01 * (t - start) + (0.3 if i % 2 else -0.3))
    assert fc.slope() == pytest.approx(0.01, abs=2e-3)
    assert len(fc.points) == 81


def test_forecast_needs_points_and_never_forecasts_cooling_or_a_glitch() -> None:
    fc = Forecast(window_s=20, horizon_s=10, min_points=4, max_rise_c=5)
    for t in range(3):
        fc.add(float(t), 60.0 + t)
    assert fc.slope() is None
    assert fc.predict(62.0, fc.slope()) == 62.0
    assert fc.predict(62.0, -1.0) == 62.0  # cooling: act on the reading
    assert fc.predict(62.0, 10.0) == 67.0  # capped at max_rise_c


def test_forecast_forgets_points_outside_the_window() -> None:
    fc = Forecast(window_s=5, horizon_s=10, min_points=2, max_rise_c=15)
    for t in range(10):
        fc.add(float(t), 90.0 if t < 4 else 50.0)
    assert fc.slope() == pytest.approx(0.0)


def test_busy_window_is_time_weighted() -> None:
    win = BusyWindow(window_s=10)
    for t in range(10):
        win.add(float(t), t < 5)  # busy for 5 s, then idle
    assert win.fraction(9.0) == pytest.approx(0.5)
    for t in range(10, 20):
        win.add(float(t), False)
    assert win.fraction(19.0) == pytest.approx(0.0)


def test_busy_window_irregular_ticks() -> None:
    win = BusyWindow(window_s=4)
    for t, busy in [(0.0, True), (0.25, True), (3.0, False), (4.0, False)]:
        win.add(t, busy)
    assert win.fraction(4.0) == pytest.approx(3.0 / 4)


def test_pi_bumpless_start_gives_the_current_level() -> None:
    pi = PIController.with_defaults(77.0, 70.0, None, None, None)
    pi.start(77.0, 78.0, level=0.6, t=0.0)
    assert pi.update(77.0, 78.0, 0.0) == pytest.approx(0.6)


def test_pi_started_below_the_setpoint_does_not_sag_on_the_way_up() -> None:
    """Entered on a forecast at 74 °C with the engine at full power: until the setpoint nothing is cut (the
    kernel would not throttle either); a seed that matched only the first output sagged to ~0.2 at 76.9 °C."""
    pi = PIController.with_defaults(77.0, 70.0, None, None, None)
    pi.start(77.0, 74.0, level=1.0, t=0.0)
    outs = [pi.update(77.0, temp, float(i)) for i, temp in enumerate([74.0, 75.0, 76.0, 76.5, 76.9, 77.0], 1)]
    assert outs == [1.0] * 6
    assert pi.update(77.0, 77.5, 7.0) < 1.0  # over the setpoint it cuts at once


def test_pi_default_gains_follow_power_allocator() -> None:
    pi = PIController.with_defaults(77.0, 72.0, None, None, None)
    assert (pi.k_pu, pi.k_po, pi.k_i) == pytest.approx((0.4, 0.2, 0.04))


def test_pi_integrates_and_anti_windup_stops_at_saturation() -> None:
    pi = PIController.with_defaults(77.0, 70.0, None, None, None)
    pi.start(77.0, 77.0, level=0.5, t=0.0)
    outs = [pi.update(77.0, 77.5, float(t)) for t in range(1, 40)]  # 0.5 °C over the setpoint
    assert outs[0] > outs[5] > outs[20]
    assert outs[-1] == 0.0
    frozen = pi.integral
    pi.update(77.0, 77.5, 40.0)
    assert pi.integral == frozen  # saturated: no wind-up
    # Once cooler, the output leaves 0 at once instead of unwinding a huge integral.
    assert pi.update(77.0, 76.0, 41.0) > 0.0


def test_pi_hotter_reading_never_gives_more() -> None:
    for temp_a, temp_b in [(70.0, 71.0), (76.9, 77.1), (60.0, 90.0), (78.0, 78.5)]:
        a = PIController.with_defaults(77.0, 70.0, None, None, None)
        b = PIController.with_defaults(77.0, 70.0, None, None, None)
        for pi in (a, b):
            pi.start(77.0, 75.0, level=0.5, t=0.0)
        assert a.update(77.0, temp_a, 1.0) >= b.update(77.0, temp_b, 1.0)


def test_pi_pure_p_controller_keeps_the_bumpless_start() -> None:
    pi = PIController.with_defaults(77.0, 70.0, None, None, 0.0)
    pi.start(77.0, 78.0, level=0.3, t=0.0)
    assert pi.update(77.0, 78.0, 1.0) == pytest.approx(0.3)
    below = PIController.with_defaults(77.0, 70.0, None, None, 0.0)
    below.start(77.0, 75.0, level=0.3, t=0.0)
    assert below.update(77.0, 77.0, 1.0) == pytest.approx(0.3)  # the level holds at the setpoint
