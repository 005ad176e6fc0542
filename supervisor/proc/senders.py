"""Who may speak on the heartbeat channel: the attempt's own processes, and no one else.

A heartbeat moves rtrain: a step one pushes the hang deadline out, a `persist` one starts a copy,
`save_begin` extends the allowance, `exiting` ends a rank's watch. So a datagram counts only
when the kernel says (SCM_CREDENTIALS, which a sender cannot forge without CAP_SYS_ADMIN or
CAP_SETUID) that it came from a process of rtrain's own user, and that process is the attempt's:

- it carries the attempt's token (RTRAIN_CONTROL_TOKEN: new per attempt, in the environment of
  the attempt's processes alone, which no other user may read), or
- its ancestry reaches the attempt's root, the process rtrain started (torchrun's ranks and the
  script's own children below it included).

The token covers a sender gone before its datagram was read (a forked checkpoint writer that
reports and exits); the ancestry covers a script that sends its own datagrams without it. A pid
placed once is known for the attempt, so its last words (`stop`, `exiting`), often read after
it exited, still count. Everything else is refused and counted, by sender, for one line after
the attempt. `refusal` is the pure rule; `ancestry` the one read of /proc it needs.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

MAX_DEPTH = 64  # parents walked up from a sender: a real tree is a few levels deep


def ancestry(pid: int) -> list[int] | None:
    """`pid` and its parents up to pid 1 (or MAX_DEPTH), from /proc; None when `pid` is gone."""
    chain = [pid]
    while len(chain) < MAX_DEPTH and chain[-1] > 1:
        ppid = _ppid(chain[-1])
        if ppid is None:
            return None if len(chain) == 1 else chain
        chain.append(ppid)
    return chain


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The name (field 2) may hold spaces and parentheses: fields after its last ")".
        return int(stat[stat.rfind(b")") + 2:].split(None, 2)[1])
    except (OSError, ValueError, IndexError):
        return None


def refusal(*, uid: int, own_uid: int, pid: int, root: int, token_ok: bool,
            chain: list[int] | None) -> str | None:
    """Why a datagram from (`pid`, `uid`) is refused, or None to accept it: the sender is of
    this user, and it carries the attempt's token (`token_ok`) or `root` (the attempt's first
    process) is the sender or one of its ancestors (`chain`: the sender's ancestry, None when
    it is gone)."""
    if uid != own_uid:
        return f"uid {uid}"
    if token_ok or pid == root:
        return None
    if chain is None:
        return "a process that exited before it could be placed"
    if root in chain:
        return None
    return "a process outside the attempt"


@dataclass
class SenderGate:
    """The attempt's senders: checked on first hearing, then known until the next attempt."""

    root: int = field(default_factory=os.getpid)
    token: str | None = None  # the attempt's RTRAIN_CONTROL_TOKEN
    own_uid: int = field(default_factory=os.geteuid)
    known: set[int] = field(default_factory=set)
    refused: dict[str, int] = field(default_factory=dict)  # "pid P (why)" -> datagrams

    def attempt(self, root: int, token: str | None = None) -> None:
        """A new attempt's root process and token: earlier senders are forgotten (pids are
        reused)."""
        self.root, self.token, self.known = root, token, set()

    def admit(self, pid: int, uid: int, token: str | None = None) -> bool:
        if uid == self.own_uid and pid in self.known:
            return True
        token_ok = (self.token is not None and isinstance(token, str)
                    and hmac.compare_digest(token.encode(), self.token.encode()))
        placed = uid == self.own_uid and not token_ok and pid != self.root
        chain = ancestry(pid) if placed else None
        why = refusal(uid=uid, own_uid=self.own_uid, pid=pid, root=self.root,
                      token_ok=token_ok, chain=chain)
        if why is None:
            self.known.add(pid)
            return True
        name = f"pid {pid} ({why})"
        if name in self.refused or len(self.refused) < 16:  # bounded: a flood of new pids
            self.refused[name] = self.refused.get(name, 0) + 1
        else:
            self.refused["others"] = self.refused.get("others", 0) + 1
        return False

    def take_refused(self) -> dict[str, int]:
        """The refusals since the last call (for the attempt's one line), and forget them."""
        out, self.refused = self.refused, {}
        return out
