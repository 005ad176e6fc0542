"""rtrain worker: the library used inside a training script.

    import worker
    ckpt = worker.Checkpointer(model=model, optimizer=opt, sampler=sampler, every_steps=100)
    start_step = ckpt.restore()
"""

from supervisor import __version__
from worker.checkpointer import Checkpointer
from worker.runtime import heartbeat, request_stop, should_stop
from worker.sampler import ResumableSampler
from worker.settings import Settings, settings

__all__ = ["Checkpointer", "ResumableSampler", "Settings", "__version__", "heartbeat",
           "request_stop", "settings", "should_stop"]
