"""The storage behind a mirror URL: which fsspec filesystem, opened with which bounds.

fsspec (and the protocol's backend, s3fs for `s3://`) is imported only here, and only when a
mirror is opened: `rtrain inspect DIR` never pays for it. Credentials and endpoint come only
from the backend's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL /
AWS_PROFILE for S3); a URL that carries them is refused without showing them.
"""

from __future__ import annotations

import os
from typing import Any

from supervisor.remote.errors import MirrorError
from supervisor.remote.url import redact, scheme

# S3 timeouts and retries, so that a dead endpoint fails an operation instead of hanging it:
# - one that refuses or never accepts the connection: BOTOCORE_ATTEMPTS x CONNECT_TIMEOUT_S
#   (15 s; s3fs does not retry connection errors);
# - one that accepts and then stalls: each read waits READ_TIMEOUT_S, retried by botocore and
#   again by s3fs: at most S3FS_RETRIES x BOTOCORE_ATTEMPTS x 60 s (6 min) plus backoff.
# 60 s, not less: a slow store may legitimately pause that long before answering a large PUT.
# Uploads go without "Expect: 100-continue" (`_no_expect_continue`), or the stalled case would
# have no bound at all.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
BOTOCORE_ATTEMPTS = 3  # botocore "standard" retry mode: throttling and transient 5xx too
S3FS_RETRIES = 2  # s3fs's loop around each call: timeouts, connections dropped mid-body

_S3 = ("s3", "s3a")
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def open_filesystem(url: str) -> tuple[Any, str, bool]:
    """`(fs, root, local)` for `url`: `s3://bucket/prefix`, `gs://...`, `file:///path`, or a
    plain path (a shared filesystem; `local` True). Nothing is contacted yet."""
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
                "connect_timeout": CONNECT_TIMEOUT_S,
                "read_timeout": READ_TIMEOUT_S,
                "retries": {"max_attempts": BOTOCORE_ATTEMPTS, "mode": "standard"},
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
