"""A newer checkpoint of the run on its mirror than in the local dir, brought in before a
pick: a fresh machine (or a lost local dir) resumes from where the run got to. Handed to the
loop's checkpoints (`Checkpoints.fetch_newer`) by the mirror feature."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rtrain.checkpoint import runid
from rtrain.checkpoint.verify import Level, Status, Verdict
from rtrain.supervisor.core.untrusted_text import safe
from rtrain.supervisor.mirror.cache import BlobCache
from rtrain.supervisor.mirror.launch_uploads import Mirroring
from rtrain.supervisor.mirror.store import CorruptRemote, MirrorError, checkpoints
from rtrain.supervisor.mirror.verify_remote import verify_remote
from rtrain.supervisor.records.events import EventLog


class NewerOnMirror:
    def __init__(self, mirroring: Mirroring, ckpt_dir: Path, key: bytes | None, *,
                 file_mode: int, events: EventLog, say: Callable[[str], None]) -> None:
        self.mirroring, self.dir, self.key, self.file_mode = mirroring, ckpt_dir, key, file_mode
        self.events, self.say = events, say

    def __call__(self, local: Verdict | None, since: float | None = None) -> bool:
        """Download this run's newest checkpoint on the mirror that is newer than `local` and
        verifies (quick on the listing, then hashed while it downloads); one that does not
        verify is reported and the next older tried. Local wins at an equal step. This run:
        the checkpoint dir's identity, else the local pick's; on a machine with neither, the
        run that committed last to the mirror (`runid.continued_run`). Another run's
        checkpoints under the same URL are said and never resumed from. With `since` (the run
        started over then), one made before it is the earlier run's: passed over. True when
        one was downloaded."""
        mirror, where = self.mirroring.mirror, self.mirroring.display
        if not self.mirroring.answered:
            return False  # said at the probe: resuming from local checkpoints
        floor = local.step if local is not None else -1
        try:
            # One listing; a manifest read only for what is newer than the local pick.
            inventory = mirror.inventory()
            found = [verify_remote(mirror, rc, Level.QUICK, self.key, inventory[rc.name])
                     for rc in checkpoints(inventory) if rc.step > floor]
        except MirrorError as e:
            self.say(f"{e}; resuming from local checkpoints")
            self.events.emit("mirror_failed", reason=f"list: {e}", step=None, retry_in_s=None,
                             given_up=False)
            return False
        ok = [v for v in found if v.ok]
        run = runid.read(self.dir) or (runid.of(local.manifest) if local is not None else None)
        if run is None:
            run = runid.continued_run((runid.of(v.manifest), v.manifest["created"]) for v in ok)
        others = {v.step: runid.of(v.manifest) for v in ok if runid.of(v.manifest) != run}
        if others:
            newest = max(others)
            line = (f"mirror {where}: the mirror prefix holds checkpoints of another run (step "
                    f"{newest}, {runid.whose(others[newest])}): not resumed from; this run "
                    f"({runid.short(run)}) resumes from its own")
            self.say(line)
            self.events.emit("mirror_other_run", steps=sorted(others), newest=newest,
                             reason=line)
        for v in found:
            if v.status is Status.INCOMPLETE or (v.ok and runid.of(v.manifest) != run):
                continue
            if not v.ok:
                self._skip_remote(where, v.path.name, v.reason)
                continue
            try:
                if since is not None and not _made_since(v.manifest, since):
                    self.say(f"skipping {v.path.name} on the mirror: made before this run "
                             "started over (--resume never)")
                    continue
                t = mirror.download(v.path.name, self.dir, key=self.key, cache=BlobCache(),
                                    file_mode=self.file_mode)
            except CorruptRemote as e:
                self._skip_remote(where, v.path.name, str(e))
                continue
            except MirrorError as e:
                self.say(f"{e}; resuming from local checkpoints")
                self.events.emit("mirror_failed", reason=f"download: {e}", step=v.step,
                                 retry_in_s=None, given_up=False)
                return False
            self.say(f"downloaded {v.path.name} from the mirror: {t.bytes / 2**20:.1f} MiB in "
                     f"{t.seconds:.1f} s ({t.cached_bytes / 2**20:.1f} MiB from the cache)")
            self.events.emit("mirror_downloaded", step=v.step, bytes=t.bytes,
                             seconds=round(t.seconds, 3), cached_bytes=t.cached_bytes)
            return True
        return False

    def _skip_remote(self, where: str, name: str, reason: str) -> None:
        self.say(f"skipping {safe(name)} on the mirror: {safe(reason)}")
        self.events.emit("skipped_checkpoint", path=f"{where}/{name}",
                         reason=f"on the mirror: {reason}")


def _made_since(m: dict, since: float) -> bool:
    created = m.get("created")
    return isinstance(created, (int, float)) and not isinstance(created, bool) and (
        created >= since)
