"""The mirror's failures: one exception tree whose messages say what to change, and the
wording of storage errors without their text (which may quote request details)."""

from __future__ import annotations

from supervisor.errors import RtrainError


class MirrorError(RtrainError):
    """The mirror cannot be used as asked; str() is one line saying what to change."""


class CorruptRemote(MirrorError):
    """A remote checkpoint whose manifest or files cannot be trusted; nothing was kept."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


class CorruptLocal(MirrorError):
    """A local checkpoint that fails its own manifest: it is not uploaded."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason} (not uploaded)")
        self.name = name
        self.reason = reason


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def explain(exc: BaseException, *, local: bool = False) -> str:
    """`(kind): what to check` for a storage error, from exception classes and S3 error codes
    only: an error's own text may quote request details, never shown. `local`: the mirror is a
    filesystem path (permissions, not credentials)."""
    chain = _chain(exc)
    names = {cls.__name__ for e in chain for cls in type(e).__mro__}
    codes = [e.response.get("Error", {}).get("Code") for e in chain
             if isinstance(getattr(e, "response", None), dict)]
    kind = next((c for c in codes if c), None) or type(exc).__name__
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (f"({kind}): no credentials found: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionError", "TimeoutError", "ClientConnectorError",
                "ServerDisconnectedError"}:
        return (f"({kind}): the endpoint does not answer: check AWS_ENDPOINT_URL (or the "
                "region) and the network")
    if "PermissionError" in names or set(codes) & {
            "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"}:
        if local:
            return f"({kind}): check the directory's owner and permissions"
        return (f"({kind}): check AWS credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE) / bucket policy")
    if "FileNotFoundError" in names or "NoSuchBucket" in codes:
        return f"({kind}): check the {'path' if local else 'bucket name and prefix'}"
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        return f"({kind}: {exc.strerror})"
    return f"({kind})"
