"""`governor sweep`: run a policy over a grid of overridden thresholds, on every core, and rank the results.

`--policy constant` sweeps fixed settings instead (`--param threads=1,2,3,4 --param freq=0.6,0.8,1.0`): the best
constant configuration that stays under the trip, what the online controller is measured against.

Score (higher is better): the tokens generated, for runs whose peak stays below the device's trip with no OOM kill
and no failed answer; any other run scores 0 (disqualified). Ties go to the lower energy per token.
"""

from __future__ import annotations

import csv
import itertools
import logging
import os
import tomllib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from govbase.errors import GovernorError
from governor import logs
from governor.lab.deciders import CONSTANT, decider_for, parse_constant
from governor.lab.device import DeviceSpec
from governor.lab.experiment import Summary, simulate
from governor.lab.workload import WorkloadSpec
from policies import Policy


class SweepError(GovernorError):
    pass


@dataclass(frozen=True)
class Param:
    key: str  # dotted path into the policy, e.g. "thermal.hot_margin_c" or "states.hot.min_threads"
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Result:
    values: dict[str, Any]
    summary: Summary | None
    error: str | None = None

    @property
    def score(self) -> float:
        s = self.summary
        if s is None or s.peak_c >= s.trip_c or s.oom_kills or s.failed:
            return 0.0
        return s.tokens


def _scalar(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string (e.g. a KV type or a model tier)


def parse_param(text: str) -> Param:
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise SweepError(f"--param {text!r}: expected KEY=v1,v2,... (e.g. thermal.hot_margin_c=3,5,8)")
    return Param(key.strip(), tuple(_scalar(v.strip()) for v in values.split(",")))


def override(policy: Policy, values: dict[str, Any]) -> Policy:
    data = policy.model_dump(mode="json")
    for key, value in values.items():
        node = data
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                raise SweepError(f"--param {key}: the policy has no table {part!r}")
            node = node[part]
        if last not in node:
            raise SweepError(f"--param {key}: the policy has no field {last!r} (known: {', '.join(sorted(node))})")
        node[last] = value
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SweepError(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from exc


def _quiet() -> None:
    logs.configure(level=logging.WARNING)


def _run(
    device: DeviceSpec, policy: Policy | str, workload: WorkloadSpec, values: dict[str, Any], minutes: float | None
) -> Result:
    name = policy if isinstance(policy, str) else policy.name
    summary = simulate(device, decider_for(policy, device), workload, policy_name=name, minutes=minutes).summary
    return Result(values, summary)


def constant(values: dict[str, Any]) -> str:
    """A constant setting (`--policy constant --param threads=1,2 --param freq=0.6,1.0`) as the lab names it."""
    name = f"{CONSTANT}:" + ",".join(f"{k}={v}" for k, v in values.items())
    try:
        parse_constant(name)
    except GovernorError as exc:
        raise SweepError(str(exc)) from exc
    return name


def sweep(
    device: DeviceSpec,
    policy: Policy | str,
    workload: WorkloadSpec,
    params: Sequence[Param],
    *,
    minutes: float | None = None,
    jobs: int | None = None,
) -> list[Result]:
    """Every combination, run in parallel (one process per core by default); invalid combinations are reported."""
    keys = [p.key for p in params]
    combos = [dict(zip(keys, vs, strict=True)) for vs in itertools.product(*(p.values for p in params))]
    results: list[Result | None] = [None] * len(combos)
    futures = {}
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1, initializer=_quiet) as pool:
        for i, values in enumerate(combos):
            try:
                varied = constant(values) if isinstance(policy, str) else override(policy, values)
            except SweepError as exc:
                results[i] = Result(values, None, str(exc))
                continue
            futures[i] = pool.submit(_run, device, varied, workload, values, minutes)
        for i, future in futures.items():
            results[i] = future.result()
    return [r for r in results if r is not None]


def best(results: Sequence[Result]) -> Result | None:
    ranked = [r for r in results if r.summary is not None and r.score > 0]
    if not ranked:
        return None
    return max(ranked, key=lambda r: (r.score, -(r.summary.j_per_token or 0.0) if r.summary else 0.0))


def write_csv(results: Sequence[Result], path: Path) -> None:
    keys = list(results[0].values) if results else []
    fields = list(Summary.model_fields)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*keys, "score", "error", *fields])
        for r in results:
            summary = r.summary.model_dump() if r.summary else {}
            writer.writerow([*(r.values[k] for k in keys), r.score, r.error or "", *(summary.get(k) for k in fields)])


def plot(results: Sequence[Result], params: Sequence[Param], path: Path) -> None:
    """One parameter: tokens and peak against it. Two: a score heat map. More: the ten best combinations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.summary is not None]
    fig, ax = plt.subplots(figsize=(8, 5))
    if not ok:
        ax.text(0.5, 0.5, "no valid combination", ha="center")
    elif len(params) == 1:
        key = params[0].key
        xs = [str(r.values[key]) for r in ok]
        ax.plot(xs, [r.summary.tokens for r in ok if r.summary], "o-", label="tokens")
        ax.set_xlabel(key)
        ax.set_ylabel("tokens generated")
        twin = ax.twinx()
        twin.plot(xs, [r.summary.peak_c for r in ok if r.summary], "s--", color="C3", label="peak °C")
        twin.axhline(ok[0].summary.trip_c if ok[0].summary else 0, color="C3", lw=0.8, ls=":")
        twin.set_ylabel("peak °C (dotted: trip)")
    elif len(params) == 2:
        (a, b) = (params[0], params[1])
        scores = {(r.values[a.key], r.values[b.key]): r.score for r in ok}
        grid = [[scores.get((va, vb), 0.0) for va in a.values] for vb in b.values]
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(a.values)), [str(v) for v in a.values])
        ax.set_yticks(range(len(b.values)), [str(v) for v in b.values])
        ax.set_xlabel(a.key)
        ax.set_ylabel(b.key)
        fig.colorbar(image, ax=ax, label="score (tokens; 0 = over the trip or OOM)")
    else:
        top = sorted(ok, key=lambda r: r.score, reverse=True)[:10]
        labels = [", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in r.values.items()) for r in top]
        ax.barh(labels[::-1], [r.score for r in top][::-1])
        ax.set_xlabel("score (tokens; 0 = over the trip or OOM)")
        ax.tick_params(axis="y", labelsize=7)
    ax.set_title("policy sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
