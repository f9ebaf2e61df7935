"""`governor run --engine llama-server`: llama.cpp's own server (built by `make setup` from the pinned sources) as the
managed engine, end to end on the real SmolLM2 ladder: a chat kept across restarts for threads, n_ctx, KV type and
model, a SIGSEGV and a kill -9, hot -> fewer threads and a clock cap, and what status says it can change live."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from governor.engine.client import EngineError
from governor.programs import find_program
from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc, device_tree
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

pytestmark = pytest.mark.slow

ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
# Two threads (this machine's cores) whether idle or answering: a chat restarts nothing by itself.
POLICY = (
    TEST_POLICY.replace("threads = 4\n", "threads = 2\n")
    .replace("n_ctx = 1024\n", "n_ctx = 2048\n")
    .replace("[states.low_battery]\nthreads = 2\n", '[states.low_battery]\nthreads = 2\nkv_type = "q8_0"\n')
    .replace("[states.hot]\nthreads = 2\nmin_threads = 1\n", "[states.hot]\nthreads = 1\nmin_threads = 1\n")
)
CONFIG = 'engine = "llama-server"\n[restart]\ninitial_s = 0.2\n'
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
QUESTIONS = (
    "What is the capital of France?",
    "And what is the capital of Italy?",
    "Which of the two cities is larger?",
    "Name a river in the first city.",
    "Name a river in the second city.",
    "Thank you. Which language is spoken there?",
)


def hot_tree(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.cluster(0, range(4), max_khz=2_400_000, min_khz=600_000, available=(600_000, 1_200_000, 1_800_000, 2_400_000))
    return tree


@pytest.fixture
def server(tmp_path: Path, sock_dir: Path, real_ladder: Path) -> Iterator[DaemonProc]:
    find_program("llama-server")  # make setup builds it: its absence is a broken set-up, not a reason to skip
    d = DaemonProc(tmp_path, sock_dir, real_ladder, policy=POLICY, config=CONFIG, tree=hot_tree)
    try:
        d.wait_ready(timeout_s=180)
        yield d
    finally:
        assert d.stop() == 0


class Chat:
    """One conversation through the daemon's public socket, as an OpenAI client sends it: the whole history."""

    def __init__(self, d: DaemonProc) -> None:
        self.d = d
        self.messages: list[dict[str, str]] = [SYSTEM]
        self.answers: list[dict[str, Any]] = []

    def turn(self, question: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question})
        answer = self.d.engine.chat(self.messages, max_tokens=24, temperature=0.0)
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.answers.append(answer)
        return answer

    def tokens_so_far(self) -> int:
        usage = self.answers[-1]["usage"]
        return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def cached(answer: dict[str, Any]) -> int:
    """How many of this turn's prompt tokens llama-server found in its cache (not evaluated again)."""
    return int(answer["timings"]["cache_n"])


def restarted_with(d: DaemonProc, starts: int, flag: str, value: str) -> dict[str, Any]:
    """The status once the engine was started again (start number `starts` + 1), ready, with `flag value`."""

    def check() -> dict[str, Any]:
        status = d.status()
        assert status["supervisor"]["starts"] > starts, status["supervisor"]
        assert status["supervisor"]["ready"], status["supervisor"]
        argv = Path(f"/proc/{status['supervisor']['pid']}/cmdline").read_bytes().split(b"\0")
        assert flag.encode() in argv, argv  # a restart for another reason may come first: wait for this one
        assert argv[argv.index(flag.encode()) + 1] == value.encode(), argv
        return status

    return eventually(check, timeout_s=180, interval_s=0.2)


def events_named(d: DaemonProc, name: str) -> list[dict[str, Any]]:
    return [e for e in d.events() if e.get("event") == name]


def test_the_readmes_curl_streams_an_answer_and_status_names_the_engine(server: DaemonProc) -> None:
    body = '{"messages":[{"role":"user","content":"What is the capital of France? Answer in one sentence."}],'
    curl = subprocess.run(
        ["curl", "-sN", "--unix-socket", str(server.engine_socket), "http://x/v1/chat/completions",
         "-H", "content-type: application/json", "-d", body + '"stream":true}'],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    events = [line.removeprefix("data: ") for line in curl.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text.strip()  # sampled (the README's request sets no temperature): some answer, not a fixed one
    assert json.loads(events[0])["model"] == "large"

    driver = server.status()["actuators"]["engine"]["driver"]

    assert driver["engine"] == "llama-server"
    assert driver["live"] == ["max_tokens_per_s"]
    assert driver["reload"] == []
    assert set(driver["restart"]) >= {"threads", "n_ctx", "kv_type", "model", "n_batch"}


def test_a_chat_survives_threads_context_kv_and_model_changes(server: DaemonProc) -> None:
    d, chat = server, Chat(server)
    first = chat.turn(QUESTIONS[0])
    assert first["choices"][0]["message"]["content"].strip()

    def change_and_turn(question: str, flag: str, value: str, **hold: Any) -> dict[str, Any]:
        before, starts = chat.tokens_so_far(), d.status()["supervisor"]["starts"]
        with d.client.hold(**hold):
            restarted_with(d, starts, flag, value)
            answer = chat.turn(question)
        assert answer["choices"][0]["message"]["content"].strip()
        return {"before": before, "answer": answer, "starts": d.status()["supervisor"]["starts"]}

    # threads 2 -> 1: a restart, the slot saved before and restored after: the next turn evaluates only its news
    t = change_and_turn(QUESTIONS[1], "--threads", "1", max_threads=1)
    assert cached(t["answer"]) >= t["before"] - 2
    restored = events_named(d, "slot restored")
    assert restored
    assert restored[-1]["tokens"] >= t["before"] - 2

    # n_ctx 2048 -> 1024: the conversation fits, the slot is restored into the smaller context
    t = change_and_turn(QUESTIONS[2], "--ctx-size", "1024", max_ctx=1024)
    assert cached(t["answer"]) >= t["before"] - 2

    # KV f16 -> q8_0: llama.cpp cannot load an f16 slot into a q8_0 cache: the tokens are evaluated again in the
    # background, so the next turn still finds them cached
    starts = d.status()["supervisor"]["starts"]
    before = chat.tokens_so_far()
    with d.client.hold(state="low_battery"):
        restarted_with(d, starts, "--cache-type-k", "q8_0")
        eventually(lambda: events_named(d, "conversation evaluated again"), timeout_s=120)
        answer = chat.turn(QUESTIONS[3])
    assert cached(answer) >= before - 2

    # model large -> small: another file (the same tokenizer here): the conversation's text is evaluated again
    starts, before = d.status()["supervisor"]["starts"], chat.tokens_so_far()
    evaluated = len(events_named(d, "conversation evaluated again"))
    with d.client.hold(max_tier="small"):
        restarted_with(d, starts, "--alias", "small")
        eventually(lambda: len(events_named(d, "conversation evaluated again")) > evaluated, timeout_s=120)
        answer = chat.turn(QUESTIONS[4])
    assert cached(answer) >= before // 2  # text tokenized anew: the prefix up to the first difference
    assert d.status()["supervisor"]["failures"] == 0  # restarts to change settings are not deaths


def test_sigsegv_in_the_first_decode_and_kill_9_restart_it_and_the_chat_goes_on(server: DaemonProc) -> None:
    d, chat = server, Chat(server)
    pid = d.status()["supervisor"]["pid"]
    chat.messages.append({"role": "user", "content": "Write a long story about a lighthouse keeper."})
    stream = d.engine.stream_chat(chat.messages, max_tokens=400)
    next(stream)  # the answer has begun: the engine is in its first decode
    os.kill(pid, signal.SIGSEGV)
    with pytest.raises(EngineError, match=r"the engine died while answering: engine killed by SIGSEGV"):
        for _chunk in stream:
            pass
    chat.messages.pop()

    status = eventually(lambda: (s := d.status())["supervisor"]["ready"] and s["supervisor"]["starts"] > 1 and s,
                        timeout_s=180, interval_s=0.2)  # fmt: skip
    assert "in the first decode; restarting with extra buffers off" in status["supervisor"]["last_exit"]
    argv = Path(f"/proc/{status['supervisor']['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--no-repack" in argv  # the crash's safer setting: llama.cpp's extra buffer types off
    assert chat.turn(QUESTIONS[0])["choices"][0]["message"]["content"].strip()

    os.kill(status["supervisor"]["pid"], signal.SIGKILL)
    status = eventually(lambda: (s := d.status())["supervisor"]["ready"] and s["supervisor"]["starts"] > 2 and s,
                        timeout_s=180, interval_s=0.2)  # fmt: skip
    assert "SIGKILL" in status["supervisor"]["last_exit"]
    assert chat.turn(QUESTIONS[1])["choices"][0]["message"]["content"].strip()


def test_hot_caps_the_clock_and_restarts_it_on_fewer_threads(server: DaemonProc) -> None:
    d = server
    starts = d.status()["supervisor"]["starts"]
    d.tree.write(ZONE_TEMP, 95000)

    status = restarted_with(d, starts, "--threads", "1")

    assert status["state"] == "hot"
    max_freq = d.tree.path("sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq")
    eventually(lambda: int(max_freq.read_text()) < 2_400_000, timeout_s=30)
    assert Chat(d).turn(QUESTIONS[0])["choices"][0]["message"]["content"].strip()
