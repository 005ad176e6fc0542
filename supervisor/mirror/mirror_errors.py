"""What goes wrong with a mirror, as named failures, and the one line a user reads about it.

Every failure of the storage reaches callers as a `MirrorError`: `Unreachable` when the endpoint
does not answer (perhaps for a while only: a launch keeps training through it), `CorruptRemote`
and `CorruptLocal` when a checkpoint cannot be trusted. A storage error is named by its class or
S3 error code with what to check (`explain`), never by its text, which may quote request details.
"""

from __future__ import annotations

from rtrain.supervisor.core.errors import RtrainError


class MirrorError(RtrainError):
    """The mirror cannot be used as asked; str() is one line saying what to change."""


class CorruptRemote(MirrorError):
    """A remote checkpoint whose manifest or files cannot be trusted; nothing was kept."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


class Unreachable(MirrorError):
    """The endpoint does not answer (refused, timed out, dropped): perhaps for a while only."""


class CorruptLocal(MirrorError):
    """A local checkpoint that fails its own manifest: it is not uploaded."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason} (not uploaded)")
        self.name = name
        self.reason = reason


class OtherRun(MirrorError):
    """A committed remote checkpoint of another run stands where this run's would go: it is
    left as it is and this run's is not uploaded."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


_UNREACHABLE = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                          "ConnectionError", "TimeoutError", "ClientConnectorError",
                          "ServerDisconnectedError"})


def _names(exc: BaseException) -> set[str]:
    """Class names along the exception's chain, bases included."""
    return {cls.__name__ for e in _chain(exc) for cls in type(e).__mro__}


def is_unreachable(exc: BaseException) -> bool:
    """The storage error says the endpoint did not answer (by class name: the backends' own
    exception modules are never imported here)."""
    return bool(_names(exc) & _UNREACHABLE)


def explain(exc: BaseException, *, local: bool = False) -> str:
    """`(kind): what to check` for a storage error, from exception classes and S3 error codes
    only: an error's own text may quote request details, never shown. `local`: the mirror is a
    filesystem path (permissions, not credentials)."""
    chain = _chain(exc)
    names = _names(exc)
    codes = [e.response.get("Error", {}).get("Code") for e in chain
             if isinstance(getattr(e, "response", None), dict)]
    kind = next((c for c in codes if c), None) or type(exc).__name__
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (f"({kind}): no credentials found: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
    if names & _UNREACHABLE:
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


def storage_error(display: str, what: str, exc: BaseException, *, local: bool) -> MirrorError:
    """`mirror <display>: <what> (kind): what to check`, as `Unreachable` when the endpoint did
    not answer, else as a `MirrorError`."""
    cls = Unreachable if is_unreachable(exc) else MirrorError
    return cls(f"mirror {display}: {what} {explain(exc, local=local)}")
