"""Over several nodes: the rank host joins torch's own rendezvous as torchrun's agent does.

Loaded by rank_host.py by path, in the host only, after its ranks are forked (the rendezvous
runs threads: its keep-alive, and on the node that becomes group rank 0 the TCPStore the ranks
meet in). Standard library only, torch imported by name. Nothing here is rtrain's own
rendezvous; each step is torch's (torch 2.x, torch/distributed/run.py, launcher/api.py,
elastic/agent/server/api.py and local_elastic_agent.py):

- torchrun's arguments are parsed by torchrun's own parser (`parse_args`, `config_from_args`),
  so the endpoint, the run id, the node counts and any PET_* variable mean what they mean to a
  torchrun started in their place;
- the rendezvous handler is the registry's for those parameters (launch_agent), joined with
  `next_rendezvous()`: the node's group rank, the world's size, the round's store, and the
  address of the store the ranks bootstrap from, which the group-rank-0 node serves on a port
  the kernel picks in each round (so a restarted group never meets a dead one's keys);
- the global ranks come from the agent's own `_assign_worker_ranks` over the round's store, so
  a node started by torchrun and a warm one agree on them;
- a group that ended well waits at the agents' exit barrier; then, as launch_agent does at its
  end unless a signal ended it, the rendezvous is shut down (closed for this run id: a node
  still waiting in it ends, as a torchrun would);
- over a range of nodes (`--nnodes MIN:MAX`) the group restarts when a node waits to join,
  as the agent's monitor loop restarts its workers then (`nodes_waiting`, polled every
  `--monitor-interval`); a node beyond MAX waits in the redundancy list, which nobody counts,
  so it never restarts a healthy group (and its attempt fences off no commit of the group's:
  each node keeps its own checkpoint generation, checkpoint/generation.py);
- three differences: a rendezvous found closed is joined again for a while (`join`), a node
  waiting for its round reads the rendezvous' state every tenth of a second, not every second,
  in a small group (nor from a copy a second old), nor waits a random time first
  (`join_poll_s`, `_fresh_reads`), and over a range a relaunch's last call is short and
  counts from the moment the group broke (`last_call_s`, `handler_for`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from types import SimpleNamespace

EXIT_BARRIER_S = 300.0
"""torchrun's agent's `exit_barrier_timeout` (LocalElasticAgent's default)."""
CLOSED_WAIT_S = 60.0
"""How long a closed rendezvous (the failed group's, its store not yet gone) is joined again."""
CLOSED_POLL_S = 0.2
JOIN_POLL_S = 0.1
"""How often a node waiting for its round reads the rendezvous' state, in a group of up to
POLL_NODES nodes (`join_poll_s`). torch's join loop reads it every second (`_delay(seconds=1)`
in dynamic_rendezvous) and its state holder answers from a copy for a second after each read
it made, so the node that joined first learned that the last one completed the round up to a
second later: of a warm relaunch of two nodes after a rank was killed, 1.7 s from the kill to the
first step, 1.1 s were that wait; 0.8 s without it. Only the wait between reads changes; what
each read decides is torch's."""
POLL_NODES = 10
RELAUNCH_LAST_CALL_S = 1
"""Over a range of nodes, how long a host's round waits for more nodes once it has MIN
(torch's `last_call_timeout`, whole seconds; 30 by default). A host starts a relaunch, which
follows a failed group: the nodes that survived it relaunch from their standbys within a
fraction of a second of each other, so a node not there a second later was lost whole, or comes
back cold (torchrun imports torch first). Waiting half a minute for it is what makes a node
loss cost as much as re-running torchrun; going on at once at the smaller size, the group takes
it in at its next round when it arrives (`nodes_waiting`). A first attempt (torchrun) keeps
torch's default: nodes starting together arrive seconds apart; so does the relaunch after a
group stopped to take a waiting node in (`short_last_call` False): its round waits for that
node, which joins again (the stopped host may have served the rendezvous' store), maybe cold.

The second counts from the moment the group broke, not from this host's join (`last_call_s`;
the supervisor's decide/attempt.py `group_broke_at`): the survivors' ranks raised within
milliseconds of each other as their collectives broke, and a host joins only once its failed
rank has ended, which takes a fraction of a second (a rank's way out), so a last call from the
join would wait that long again for nothing. A node whose own rank failed first (an error of
its own, a signal, a hang stopped) counts from its exit instead: its ranks' end is what broke
the others' collectives, and they come a way out later. The first host of a round sets its
deadline (torch's `_add_to_participants`), so the round completes a second after the break, or
at once when all MAX nodes are in."""
RELAUNCH_LAST_CALL_MIN_S = 0.25
"""The last call's least length, however late after the break a host joins (a rank's slow way
out): the other survivors, as late, may be a moment behind it."""


class Joined:
    """This node's place in one round of the rendezvous."""

    def __init__(self, handler: object, info: object, workers: list,
                 config: object) -> None:
        self.handler, self.info, self.workers = handler, info, workers
        self.config = config  # torchrun's LaunchConfig

    def envs(self) -> list[dict[str, str]]:
        """Each local rank's rendezvous variables, as LocalElasticAgent._start_workers sets
        them (proc/ranks.RDZV_VARIABLES), by local rank."""
        info, handler = self.info, self.handler
        boot = info.bootstrap_store_info
        out = []
        for w in sorted(self.workers, key=lambda w: w.local_rank):
            out.append({
                "RANK": str(w.global_rank), "GROUP_RANK": str(info.rank),
                "ROLE_RANK": str(w.role_rank), "WORLD_SIZE": str(w.world_size),
                "GROUP_WORLD_SIZE": str(info.world_size),
                "ROLE_WORLD_SIZE": str(w.role_world_size), "MASTER_ADDR": boot.master_addr,
                "MASTER_PORT": str(boot.master_port),
                "TORCHELASTIC_RUN_ID": handler.get_run_id(),
                "TORCHELASTIC_USE_AGENT_STORE": str(handler.use_agent_store)})
        return out

    def exit_barrier(self) -> None:
        """The agents' barrier at a group's good end (SimpleElasticAgent._exit_barrier): a node
        whose ranks ended first keeps the round's store up for the others."""
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils import store as store_util

        try:
            store_util.barrier(store=self.info.store, world_size=self.info.world_size,
                               key_prefix=_TERMINAL_STATE_SYNC_ID,
                               barrier_timeout=EXIT_BARRIER_S)
        except Exception as e:  # the agent logs it and ends as it would have
            print(f"rtrain rank host: exit barrier: {type(e).__name__}: {e}", flush=True,
                  file=sys.stderr)

    @property
    def elastic(self) -> bool:
        """Over a range of nodes: the group restarts for a node that waits to join."""
        return self.config.min_nodes < self.config.max_nodes

    def nodes_waiting(self) -> int:
        """Nodes in the rendezvous' wait list (the agent's `num_nodes_waiting`): each makes the
        next round larger. Nodes beyond MAX wait in its redundancy list and are not counted."""
        return self.handler.num_nodes_waiting()

    def shutdown(self) -> None:
        """launch_agent's last step: the handler's shutdown (best effort there too)."""
        _shutdown(self.handler)


def handler_for(torchrun_args: list[str], short_last_call: bool = True,
                failed_at: float | None = None) -> tuple[object, object]:
    """(torchrun's LaunchConfig, its rendezvous handler) for `torchrun_args`, parsed by
    torchrun's own parser and built as launch_agent builds it; over a range of nodes with the
    relaunch's short last call (relaunch_conf), counted from `failed_at` (unix time: when the
    group broke) where given, unless the arguments name one or `short_last_call` is False."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.run import config_from_args, parse_args

    config, _, _ = config_from_args(parse_args(list(torchrun_args)))
    conf = (relaunch_conf(config.rdzv_configs, config.min_nodes, config.max_nodes)
            if short_last_call else config.rdzv_configs)
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **conf)
    ours = "last_call_timeout" in conf and "last_call_timeout" not in config.rdzv_configs
    if not ours or failed_at is None or config.rdzv_backend != "c10d":
        return config, rdzv_registry.get_rendezvous_handler(params)
    return config, _c10d_handler(params, last_call_s(failed_at, time.time()))


def last_call_s(failed_at: float, now: float) -> float:
    """A relaunch's last call at `now`: what is left of RELAUNCH_LAST_CALL_S since the group
    broke at `failed_at`, at least RELAUNCH_LAST_CALL_MIN_S."""
    left = min(float(RELAUNCH_LAST_CALL_S), failed_at + RELAUNCH_LAST_CALL_S - now)
    return max(RELAUNCH_LAST_CALL_MIN_S, left)


def _c10d_handler(params: object, last_call: float) -> object:
    """torch's c10d rendezvous handler for `params` (as its registry builds it: the backend
    and store, then `create_handler`, which reads every parameter), its last call `last_call`
    seconds: the parameters hold whole seconds only, so the handler is made again with torch's
    own constructor and the same settings but that one."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
        create_handler,
    )

    backend, store = create_backend(params)
    s = create_handler(store, backend, params).settings
    timeout = RendezvousTimeout(s.timeout.join, timedelta(seconds=last_call), s.timeout.close,
                                s.timeout.heartbeat)
    return DynamicRendezvousHandler.from_backend(
        s.run_id, store, backend, s.min_nodes, s.max_nodes, params.local_addr, timeout,
        keep_alive_interval=int(s.keep_alive_interval.total_seconds()),
        keep_alive_max_attempt=s.keep_alive_max_attempt)


def relaunch_conf(conf: dict, min_nodes: int, max_nodes: int) -> dict:
    """The rendezvous configuration of a relaunch: torchrun's, with a last call of
    RELAUNCH_LAST_CALL_S over a range of nodes where it names none."""
    out = dict(conf)
    if min_nodes < max_nodes and "last_call_timeout" not in out:
        out["last_call_timeout"] = RELAUNCH_LAST_CALL_S
    return out


def join_poll_s(max_nodes: int) -> float:
    """Seconds between a waiting node's reads of the rendezvous' state: JOIN_POLL_S up to
    POLL_NODES nodes, then growing with the node count up to torch's second, so the store, which
    serves every waiting node's reads, gets no more of them than from POLL_NODES nodes polling
    that fast."""
    return min(1.0, JOIN_POLL_S * max(1.0, max_nodes / POLL_NODES))


@contextlib.contextmanager
def _polling(every_s: float):
    """torch's join loop, polling every `every_s` instead of every second while this block
    runs; in a small group (a poll under a second) without the random wait of up to 0.3 s
    before a first round, which spreads many nodes' first reads of the store (a node's
    handler is new at each relaunch, so every relaunch paid it)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torch_delay = getattr(dynamic_rendezvous, "_delay", None)
    if torch_delay is None:  # another torch: its own polling
        yield
        return

    def delay(seconds):
        if seconds == 1:
            seconds = every_s
        elif isinstance(seconds, tuple) and every_s < 1:
            return
        torch_delay(seconds)

    dynamic_rendezvous._delay = delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = torch_delay


def _fresh_reads(handler: object, every_s: float) -> None:
    """torch's state holder answers a read from its copy for a second after the last one it
    made (`_BackendRendezvousStateHolder`, `cache_duration`), so a node polling every tenth of
    a second still saw the last node's arrival, which completes the round, up to a second late
    (the first of two survivors joined, then waited a whole second for the round the second
    completed at once): the copy lasts as long as a poll. Another torch's holder is left as it
    is."""
    holder = getattr(handler, "_state_holder", None)
    cached = getattr(holder, "_cache_duration", None)
    if isinstance(cached, (int, float)) and cached > every_s:
        holder._cache_duration = every_s


def join(torchrun_args: list[str], short_last_call: bool = True,
         failed_at: float | None = None) -> Joined:
    """Join the next round of the rendezvous and take this node's ranks; raises what torchrun
    would (a timeout, a store out of reach) once the handler is shut down, as launch_agent
    shuts it down after an error.

    One difference, and why: a rendezvous found closed (or closed while this node waited in
    its redundancy list) is the failed group's, whose store lives until the last of its
    agents ends; torchrun fails at once there and rtrain relaunches it, but a warm relaunch
    comes back in a fraction of a second, and each would be a failed attempt charged to the
    run's budget. So the host joins again every CLOSED_POLL_S, with a new handler (a new
    store client, or the new store itself on the endpoint's host), for up to CLOSED_WAIT_S;
    then it fails as torchrun does. A store that went away while it was joined (the old one
    ending) is joined again the same way."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousGracefulExitError,
    )

    deadline = time.monotonic() + CLOSED_WAIT_S
    while True:
        config, handler = handler_for(torchrun_args, short_last_call, failed_at)
        every_s = join_poll_s(config.max_nodes)
        _fresh_reads(handler, every_s)
        try:
            with _polling(every_s):
                info = handler.next_rendezvous()
            break
        except (RendezvousClosedError, RendezvousGracefulExitError, RendezvousConnectionError):
            if time.monotonic() >= deadline:
                _shutdown(handler)
                raise
        except BaseException:
            _shutdown(handler)
            raise
        time.sleep(CLOSED_POLL_S)
    spec = SimpleNamespace(role=config.role, local_world_size=config.nproc_per_node)
    # The agent's own assignment; it never reads its `self`.
    workers = SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank,
                                                      info.world_size, spec)
    return Joined(handler, info, workers, config)


def _shutdown(handler: object) -> None:
    try:
        handler.shutdown()
    except Exception:
        pass
