"""The json adapter's data: the base model's own greedy answers, as the governor's engine gives them.

    .venv/bin/python tools/lora/base_answers.py --work /tmp/lora-work     # the project's virtualenv, not torch's

Starts `governor engine` on the Q4_1 SmolLM2 file the demo ladder serves (one thread), asks every question of
`data.json_prompts()` at temperature 0 (48 tokens at most), and writes WORK/json_targets.json: [question, the
answer's whole sentences] pairs, which make_demo_adapters.py wraps as {"answer": ...} and trains on. A few minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # tools/lora/data.py, beside this script

from governor.demo.models import smollm2_path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "engine.sock"
        cmd = [sys.executable, "-m", "governor", "engine", "--model", str(smollm2_path()), "--threads", "1"]
        engine = subprocess.Popen([*cmd, "--socket", str(sock)], stderr=subprocess.DEVNULL)
        try:
            http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=300)
            while True:  # serving once /engine/status answers
                if engine.poll() is not None:
                    raise SystemExit(f"the engine exited {engine.returncode}")
                try:
                    if http.get("/engine/status").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            pairs = []
            t0 = time.monotonic()
            for q in data.json_prompts():
                body = {"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 48}
                reply = http.post("/v1/chat/completions", json=body).json()
                pairs.append([q, data.sentences(reply["choices"][0]["message"]["content"])])
            print(f"{len(pairs)} answers in {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            engine.terminate()
            engine.wait(60)
    (args.work / "json_targets.json").write_text(json.dumps(pairs, ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
