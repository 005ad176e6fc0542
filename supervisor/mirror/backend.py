"""The storage behind a mirror URL: which fsspec filesystem, opened with which bounds.

fsspec (and the protocol's backend, s3fs for `s3://`) is imported only here, and only when a
mirror is opened: `rtrain inspect DIR` never pays for it. Credentials and endpoint come only
from the backend's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL /
AWS_PROFILE for S3); a URL that carries them is refused without showing them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rtrain.supervisor.mirror.mirror_errors import MirrorError
from rtrain.supervisor.mirror.url import redact, scheme

# S3 timeouts and retries, so that a dead endpoint fails an operation instead of hanging it.
# The two timeouts are settings (`Timeouts`, from `mirror_connect_timeout_s` and
# `mirror_read_timeout_s`); the tries are fixed:
# - one that refuses or never accepts the connection: attempts x connect_s (s3fs does not
#   retry connection errors);
# - one that accepts and then stalls: each wait for an answer takes read_s, tried by botocore
#   and again by s3fs: at most S3FS_RETRIES x attempts x read_s (`Timeouts.worst_case_s`: 20 s
#   by default) plus sub-second backoffs.
# The read timeout runs only once a request's body is sent (aiohttp starts it then): it bounds
# how long the store takes to answer, not how long an upload takes. Uploads go without
# "Expect: 100-continue" (`_no_expect_continue`), or the stalled case would have no bound.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 5.0
BOTOCORE_ATTEMPTS = 2  # tries, the first included; "standard" mode: throttling, transient 5xx
S3FS_RETRIES = 2  # s3fs's loop around each call: timeouts, connections dropped mid-body


@dataclass(frozen=True)
class Timeouts:
    """How long one remote call waits for the store: to connect, and for each answer."""

    connect_s: float = CONNECT_TIMEOUT_S
    read_s: float = READ_TIMEOUT_S
    attempts: int = BOTOCORE_ATTEMPTS

    @classmethod
    def of(cls, config: Any) -> Timeouts:
        """From a `Config` (or anything with its two mirror timeout fields)."""
        return cls(float(config.mirror_connect_timeout_s), float(config.mirror_read_timeout_s))

    def worst_case_s(self) -> float:
        """The longest one call waits on an endpoint that accepts and never answers (plus the
        backoffs between tries, under a second each)."""
        return S3FS_RETRIES * self.attempts * self.read_s


_S3 = ("s3", "s3a")
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def open_filesystem(url: str, timeouts: Timeouts | None = None) -> tuple[Any, str, bool]:
    """`(fs, root, local)` for `url`: `s3://bucket/prefix`, `gs://...`, `file:///path`, or a
    plain path (a shared filesystem; `local` True). Nothing is contacted yet. `timeouts`
    bound every S3 call (default: `Timeouts()`)."""
    timeouts = Timeouts() if timeouts is None else timeouts
    display = redact(url)
    protocol = scheme(url) or "file"
    extra = _EXTRA.get(protocol, "s3")
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise MirrorError(f"mirror {display}: fsspec is not installed (every mirror needs it, a "
                          f"local directory too): pip install 'rtrain[{extra}]'") from None
    if protocol == "file":
        from fsspec.implementations.local import LocalFileSystem

        path = url[len("file://"):] if scheme(url) else url
        if not path:
            raise MirrorError("mirror file://: name a directory, e.g. file:///shared/ckpts")
        return LocalFileSystem(auto_mkdir=True), os.path.abspath(os.path.expanduser(path)), True
    if protocol in _S3:
        try:
            import s3fs
        except ImportError:
            raise MirrorError(f"mirror {display}: s3fs is not installed: pip install "
                              "'rtrain[s3]'") from None
        from aiobotocore.session import AioSession

        session = AioSession()  # the standard chain: environment, profiles, instance role
        session.register("before-call.s3", _no_expect_continue)  # after botocore's own
        fs = s3fs.S3FileSystem(
            session=session,
            skip_instance_cache=True,  # credentials are read when the mirror is opened
            use_listings_cache=False,  # another machine may have changed the prefix
            config_kwargs={
                "connect_timeout": timeouts.connect_s,
                "read_timeout": timeouts.read_s,
                # total_max_attempts counts the first try; max_attempts would count retries only
                "retries": {"total_max_attempts": timeouts.attempts, "mode": "standard"},
            },
        )
        fs.retries = S3FS_RETRIES
    else:
        from fsspec.core import url_to_fs

        try:
            fs, _ = url_to_fs(url, skip_instance_cache=True)
        except ImportError:
            raise MirrorError(f"mirror {display}: the {protocol}:// backend is not installed: "
                              f"pip install 'rtrain[{extra}]'") from None
        except ValueError:
            raise MirrorError(f"mirror {display}: unknown protocol {protocol!r}: use s3://, "
                              "gs://, file:// or a directory path") from None
    if redact(url) != url.split("?", 1)[0].split("#", 1)[0]:
        raise MirrorError(f"mirror {display}: credentials in the URL are not read: set them in "
                          "the backend's environment (AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and leave them out of the URL")
    root = fs._strip_protocol(url).rstrip("/")
    if not root:
        raise MirrorError(f"mirror {display}: name a bucket, e.g. {protocol}://bucket/prefix")
    return fs, root, False


def _no_expect_continue(params: dict, **_: Any) -> None:
    """botocore asks for "100 Continue" before every upload body; aiohttp waits for that answer
    with no timeout at all (read_timeout does not cover it), so an endpoint that accepts the
    connection and never answers would hang an upload forever. Sent without the header, the
    body goes at once and the read timeout bounds the wait for the response."""
    params.get("headers", {}).pop("Expect", None)
