"""Heartbeats in (a unix datagram socket only the attempt's processes are heard on) and the
hang timeout learned from them.

`HangClock` is pure: it is fed heartbeats and activity with the caller's clock and answers when
the attempt counts as hung. Rules, in order:

- no heartbeat ever (a plain script, or one still importing): hung after `plain_timeout_s`
  without output and without CPU progress;
- heartbeats, but no step yet, or fewer than `warmup_steps` steps (compilation, cudnn autotune,
  the first data loader fill make these slow): hung `startup_s` after the last heartbeat;
- after warm-up: hung after clamp(`multiple` × longest step interval, `floor_s`, `ceiling_s`)
  without a heartbeat;
- while a checkpoint save runs (between `save_begin` and `save_end`), at least
  `save_allowance_s` from the save's start is allowed;
- once the worker said its interpreter is exiting (`exiting`, from its atexit hook), the
  start-up allowance again: tearing torch down sends no heartbeat either, and takes seconds on
  a loaded machine, after every step is done.

Time the supervisor itself did not run (`excuse`: it was stopped with the whole job, as Slurm's
`scontrol suspend` stops every process of it, rtrain included) does not count as silence: the
child was most likely stopped with it, so the silence starts afresh when the supervisor runs
again. A child stopped alone (it stopped itself, someone sent it SIGSTOP) is watched by a
supervisor that runs, and is hung after the timeout like any other.

Several ranks (torchrun): the last heartbeat is kept per rank, and the reference time is the
*oldest* of them, so one rank that goes silent while the others wait for it in a collective (or
keep sending) counts as a hang. A rank is tracked from its first heartbeat on; a rank that sent
`stop` or `exiting` (leaving on purpose) is no longer waited for.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rtrain.supervisor.core.protocol import Heartbeat, socket_address
from rtrain.supervisor.proc.senders import SenderGate

if TYPE_CHECKING:
    from rtrain.supervisor.config import HangConfig


@dataclass(frozen=True, kw_only=True)
class HangPolicy:
    """The hang rules' numbers. No defaults here: `from_config` builds it from `[hang]`
    (`config.HangConfig`), which owns each setting's name, default and meaning."""

    startup_s: float
    """Allowance from the first heartbeat until warm-up is over."""
    warmup_steps: int
    """Step heartbeats seen before intervals count (the first steps are slow for unrelated
    reasons)."""
    multiple: float
    """Timeout = this × the longest step interval seen after warm-up..."""
    floor_s: float
    """...but never less than this..."""
    ceiling_s: float
    """...nor more than this."""
    save_allowance_s: float
    """Allowance from a `save_begin` heartbeat until its `save_end`."""
    plain_timeout_s: float
    """Scripts without heartbeats: hung after this long with no output and no CPU progress."""

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError("hang floor must be positive and at most the ceiling")
        for name in ("startup_s", "multiple", "plain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hang {name} must be positive")
        if self.save_allowance_s < 0:  # 0 is allowed, as in [hang]: no extra time for saves
            raise ValueError("hang save_allowance_s must be zero or more")

    @classmethod
    def from_config(cls, hang: HangConfig) -> HangPolicy:
        """The policy `[hang]` asks for: its one `timeout_s` is both the plain-script timeout
        and the start-up allowance of a script that sends heartbeats."""
        return cls(startup_s=hang.timeout_s, plain_timeout_s=hang.timeout_s,
                   warmup_steps=hang.warmup_steps, multiple=hang.multiple,
                   floor_s=hang.floor_s, ceiling_s=hang.ceiling_s,
                   save_allowance_s=hang.save_allowance_s)


class HangClock:
    """What the watcher knows about liveness; all times come from the caller's monotonic clock."""

    def __init__(self, policy: HangPolicy, start: float) -> None:
        self.policy = policy
        self.last_activity = start  # output or CPU progress (plain scripts)
        self.last_heartbeat: float | None = None
        self.last_step_time: float | None = None
        self.steps = 0  # step heartbeats received
        self.max_interval: float | None = None  # longest step interval after warm-up
        self.save_started: float | None = None
        self.exiting_at: float | None = None  # the worker's atexit hook ran
        self.rank: int | None = None  # the lowest rank heard from: the one intervals come from
        self.rank_last: dict[int, float] = {}  # every rank heard from -> its last heartbeat

    def activity(self, now: float) -> None:
        self.last_activity = max(self.last_activity, now)

    def excuse(self, now: float, gap: float) -> None:
        """The supervisor did not run for the `gap` seconds before `now`: the silence starts
        afresh at `now` (a child stopped with it may be continued a moment later), and the gap
        is no step interval; a save's or an exit's allowance moves on by the gap."""
        self.last_activity = max(self.last_activity, now)
        self.rank_last = dict.fromkeys(self.rank_last, now)
        if self.last_heartbeat is not None:
            self.last_heartbeat = now
        if self.last_step_time is not None:
            self.last_step_time = now
        if self.save_started is not None:
            self.save_started += gap
        if self.exiting_at is not None:
            self.exiting_at += gap

    def heartbeat(self, hb: Heartbeat, now: float) -> None:
        if hb.event in ("stop", "exiting"):  # leaving on purpose: not waited for any more
            self.rank_last.pop(hb.rank, None)
        else:
            self.rank_last[hb.rank] = now
        # The silence that counts is the longest one: the rank heard from least recently.
        self.last_heartbeat = min(self.rank_last.values(), default=now)
        if hb.event == "exiting":
            self.exiting_at = now
        if hb.event == "save_begin":
            self.save_started = now
        elif hb.event == "save_end":
            self.save_started = None
        if self.rank is None or hb.rank < self.rank:
            self.rank, self.steps, self.last_step_time = hb.rank, 0, None
        # Ranks step in lockstep; learning from one avoids reading interleaved ranks as
        # short intervals.
        if hb.step is None or hb.event != "step" or hb.rank != self.rank:
            return
        if self.last_step_time is not None and self.steps > self.policy.warmup_steps:
            self._longest(now - self.last_step_time)
        if hb.max_step_interval is not None and self.steps >= self.policy.warmup_steps:
            # the worker times every step; our view is coarser (heartbeats are throttled)
            self._longest(hb.max_step_interval)
        self.steps += 1
        self.last_step_time = now

    def _longest(self, interval: float) -> None:
        if self.max_interval is None or interval > self.max_interval:
            self.max_interval = interval

    def timeout(self) -> tuple[float, str]:
        """(seconds allowed since the reference time, why) under the rule in force."""
        p = self.policy
        if self.last_heartbeat is None:
            return p.plain_timeout_s, "no output and no CPU progress"
        if self.max_interval is None:
            return p.startup_s, "no heartbeat (start-up allowance)"
        learned = min(max(p.multiple * self.max_interval, p.floor_s), p.ceiling_s)
        return learned, (
            f"no heartbeat (timeout learned from the longest step interval, "
            f"{self.max_interval:.3g} s)"
        )

    def deadline(self) -> float:
        """The monotonic time at which the attempt counts as hung."""
        allowed, _ = self.timeout()
        ref = self.last_activity if self.last_heartbeat is None else self.last_heartbeat
        deadline = ref + allowed
        if self.save_started is not None:
            deadline = max(deadline, self.save_started + self.policy.save_allowance_s)
        if self.exiting_at is not None:
            deadline = max(deadline, self.exiting_at + self.policy.startup_s)
        return deadline

    def check(self, now: float) -> str | None:
        """None while alive; else the sentence saying why it counts as hung."""
        deadline = self.deadline()
        if now < deadline:
            return None
        allowed, why = self.timeout()
        if self.exiting_at is not None and deadline > (self.last_heartbeat or 0) + allowed:
            return f"the process has not exited {now - self.exiting_at:.1f} s after it began to"
        if self.save_started is not None and deadline > (self.last_heartbeat or 0) + allowed:
            return f"checkpoint save still running after {now - self.save_started:.1f} s"
        ref = self.last_activity if self.last_heartbeat is None else self.last_heartbeat
        return (f"{why} for {now - ref:.1f} s (timeout {allowed:.1f} s)"
                f"{self._silent_rank(allowed)}")

    def _silent_rank(self, allowed: float) -> str:
        """Which rank has been silent longest, when several report and the others went on
        sending for at least half the timeout after it. Ranks that all stopped within a step
        of each other (one stuck, the others waiting for it in a collective) are told apart by
        the stuck-rank report (stuck/decide.py), not by which throttled heartbeat came last."""
        if len(self.rank_last) < 2:
            return ""
        rank = min(self.rank_last, key=lambda r: self.rank_last[r])
        if max(self.rank_last.values()) - self.rank_last[rank] < allowed / 2:
            return ""
        return f"; rank {rank} silent longest"


class HeartbeatReceiver:
    """The supervisor's end of RTRAIN_HEARTBEAT: a non-blocking datagram socket that only the
    attempt's own processes are heard on.

    The socket is a file in a directory of its own that only this user may enter (made anew,
    mode 0700, in the system's temporary directory: a path there fits the 108 bytes a socket
    path may have, and a run dir on a network filesystem may take no socket at all), so no other
    user can even send; where none can be made, an abstract name. Either way each datagram's
    sender, as the kernel reports it, must be this user's, and carry the attempt's token or be
    in the attempt's process tree (proc/senders.py); the rest are refused and counted
    (`gate.take_refused`)."""

    def __init__(self, name: str | None = None) -> None:
        self._dir: str | None = None
        if name is None:
            name = self._private_path()
        self.name = name
        self.gate = SenderGate()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        try:
            self.sock.bind(socket_address(self.name))
            if not self.name.startswith("@"):
                os.chmod(self.name, 0o600)
        except BaseException:
            self.close()
            raise
        self.sock.setblocking(False)

    def _private_path(self) -> str:
        """A socket path in a new directory of this user's alone; an abstract name where
        none can be made (a read-only or full temporary dir, a path too long for a socket)."""
        abstract = f"@rtrain-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._dir = tempfile.mkdtemp(prefix="rtrain-hb-")  # mode 0700
        except OSError:
            return abstract
        path = os.path.join(self._dir, "heartbeat")
        if len(os.fsencode(path)) >= _SUN_PATH_MAX:
            os.rmdir(self._dir)
            self._dir = None
            return abstract
        return path

    def fileno(self) -> int:
        return self.sock.fileno()

    def attempt(self, root: int, token: str | None = None) -> None:
        """Heard from now on: `root` (the attempt's first process), its descendants, and
        senders that carry the attempt's `token`."""
        self.gate.attempt(root, token)

    def drain(self) -> list[Heartbeat]:
        """Every heartbeat waiting now from the attempt's processes; others' datagrams are
        refused (counted), malformed or other-version ones dropped. Each heartbeat's `pid` is
        its sender's, as the kernel reports it."""
        out = []
        while True:
            try:
                raw, anc, _, _ = self.sock.recvmsg(65536, _CMSG_SPACE)
            except BlockingIOError:
                return out
            sender = _credentials(anc)
            hb = Heartbeat.decode(raw)
            token = hb.token if hb is not None else None
            if sender is None or not self.gate.admit(*sender, token):
                continue
            if hb is not None:
                hb.pid, hb.token = sender[0], None  # the kernel's word; the secret goes no further
                out.append(hb)

    def close(self) -> None:
        self.sock.close()
        if not self.name.startswith("@"):
            try:
                os.unlink(self.name)
            except FileNotFoundError:
                pass
        if self._dir is not None:
            try:
                os.rmdir(self._dir)
            except OSError:
                pass
            self._dir = None

    def __enter__(self) -> HeartbeatReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, the terminating NUL included
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)


def _credentials(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """(pid, uid) of a datagram's sender from its SCM_CREDENTIALS, which the kernel attaches
    under SO_PASSCRED; None without them."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                and len(data) >= _UCRED.size:
            pid, uid, _ = _UCRED.unpack_from(data)
            return pid, uid
    return None
