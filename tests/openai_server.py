"""vLLM's OpenAI-compatible server as a subprocess on 127.0.0.1, for the end-to-end tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests

STARTUP_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited during start-up"
        try:
            if requests.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {STARTUP_TIMEOUT_S} s")


@contextmanager
def openai_server(arguments: list[str], env: dict[str, str], log_path: Path) -> Iterator[tuple[str, dict]]:
    """Start ``python -m vllm.entrypoints.openai.api_server ARGUMENTS`` and wait until healthy.

    Yields (base URL, result); on exit sends SIGTERM and stores the exit status in result["returncode"].
    """
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(port), *arguments]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        yield f"http://127.0.0.1:{port}", result
    finally:
        process.send_signal(signal.SIGTERM)
        result["returncode"] = process.wait(timeout=120)


def completion_and_chat(base: str, model: str) -> None:
    """One greedy completion and one chat completion of 8 tokens each, answered with 200."""
    completion = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    assert choice["text"] and completion.json()["usage"]["completion_tokens"] == 8
    chat = requests.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] is not None
