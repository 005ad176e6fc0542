"""A real S3 endpoint for the mirror tests: moto's server as a child process on 127.0.0.1.

`S3Server().start()` picks a free port, starts `python -m moto.server`, waits until it answers
and creates the bucket; `env` holds what a client needs (fake credentials, the endpoint).
`stop()` then `start()` restarts it on the same port, as an endpoint that went away and came
back. moto keeps its state in memory, so a restart comes back empty but for the bucket, which
`start()` creates again: tests that restart the server upload after the restart what they later
read.

`auth=True` makes the server check credentials from the first request (moto's
INITIAL_NO_AUTH_ACTION_COUNT=0): every key is unknown to it, so every request is refused as a
store refuses a wrong key. Without it moto accepts any credentials.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

BUCKET = "rtrain-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that the OS says is free now (tests never hard-code one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, *, auth: bool = False, bucket: str = BUCKET) -> None:
        self.port = free_port()
        self.auth = auth
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        # No profile or config file of the machine running the tests may take part.
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def start(self) -> S3Server:
        env = {**os.environ, "MOTO_PORT": str(self.port)}
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not answer on {self.endpoint}")
            time.sleep(0.1)
        if not self.auth:
            self._create_bucket()
        return self

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True  # it answered
        except OSError:
            return False

    def _create_bucket(self) -> None:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
