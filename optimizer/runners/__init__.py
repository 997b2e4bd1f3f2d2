"""Trial runners, and every use of Ray: the only room that imports Ray.

``RayRunner`` runs each trial in its own Ray actor that asks for ``num_gpus`` = tensor x
pipeline parallel size; the vLLM server is a child process of the actor and inherits the
``CUDA_VISIBLE_DEVICES`` Ray assigned, so concurrent trials never share a GPU. Killing the actor
(cancel, timeout) kills its server too: the engine guard watches the actor process. A private
local Ray is started by default, never one the machine registered; an address joins a cluster.
Ray's auto-init is off wherever this module loads Ray: no Ray call starts or joins a cluster
but :func:`start_ray`. ``LocalRunner`` runs trials in a thread of the
driver (one at a time), for debugging and for machines where Ray is unwanted.

The service's Ray needs live here too, behind small functions: :class:`ClusterLossGuard` (a
trial lost with its cluster is not a result), :class:`DetachedActors` (the study drivers,
found by name after a restart), :func:`start_ray`, and the Serve application
(:mod:`optimizer.runners.serve`: :func:`serve_deployment`, :func:`serve_run`,
:func:`serve_shutdown`, :func:`serve_api_priority`); :mod:`optimizer.runners.base` holds what
both share (Ray's auto-init off, the trials' CPU priority).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from optimizer.runners.base import TRIAL_NICENESS
from optimizer.runners.base import no_auto_init as _no_auto_init
from optimizer.runners.serve import (
    serve_api_priority,
    serve_deployment,
    serve_run,
    serve_shutdown,
)
from optimizer.trial import run_trial
from optimizer.types import TrialResult, TrialSpec

__all__ = [
    "TRIAL_NICENESS",
    "ClusterLossGuard",
    "DetachedActors",
    "LocalRunner",
    "RayRunner",
    "TrialRunner",
    "check_node_sees",
    "paths_to_see",
    "ray_node",
    "serve_api_priority",
    "serve_deployment",
    "serve_run",
    "serve_shutdown",
    "start_ray",
]

log = logging.getLogger(__name__)


class _Handle:
    """A submitted trial: its spec, a future of its result, and the actor running it (Ray)."""

    def __init__(
        self,
        spec: TrialSpec,
        future: concurrent.futures.Future[TrialResult],
        actor: Any = None,
        gpus: int = 0,
    ) -> None:
        self.spec = spec
        self.future = future
        self.actor = actor
        self.gpus = gpus


class TrialRunner(Protocol):
    """Runs trials; ``capacity`` of them at once."""

    capacity: int

    def submit(self, spec: TrialSpec, gpus: int) -> _Handle:
        """Start a trial that may use ``gpus`` GPUs."""
        ...

    def cancel(self, handle: _Handle) -> None:
        """Stop a trial and its server."""
        ...

    def close(self) -> None:
        """Release the runner's resources."""
        ...


class LocalRunner:
    """Trials in a driver thread, one at a time (no Ray)."""

    capacity = 1

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="trial"
        )

    def submit(self, spec: TrialSpec, gpus: int) -> _Handle:
        return _Handle(spec, self._pool.submit(run_trial, spec, isolate_client=True))

    def cancel(self, handle: _Handle) -> None:
        # A running engine is a subprocess of this process: its guard outlives nothing, but a
        # thread cannot be interrupted; the trial finishes its replay. Queued ones are dropped.
        handle.future.cancel()

    def call(self, fn: Callable[[], Any], gpus: int = 0) -> Any:
        """Run ``fn`` here, in this process (the GPUs it sees are this process's)."""
        return fn()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _TrialActor:
    """Runs trials inside a Ray actor process, one at a time, on the GPUs Ray gave it.

    With ``spec.preload_next``, once a trial's server is healthy the actor starts the next
    trial's server interpreter (:mod:`optimizer.engine.preload`: vLLM imported, no CUDA
    initialised) while this trial replays; the next trial run by this actor starts from it when
    it asks for the same environment and interpreter, and from scratch otherwise. The
    interpreter runs under the engine guard, owned by this actor: it dies with the actor.
    """

    def __init__(self, engine_factory: Callable[[TrialSpec], Any] | None = None) -> None:
        self._warm: Any = None
        # Tests give a factory of fake engines (packing checks on logical GPUs, no vLLM).
        self._engine_factory = engine_factory
        _exit_when_raylet_dies()

    def node(self) -> str:
        """The Ray node this actor runs on (asked beside a running trial: the second slot)."""
        return ray_node()["node_id"] or ""

    def run(self, spec: TrialSpec, must_see: tuple[tuple[str, str], ...] = ()) -> TrialResult:
        """Run ``spec`` here, once this node sees every path of ``must_see`` (what, path):
        :func:`check_node_sees` raises before anything starts or is written."""
        check_node_sees(spec, must_see)
        # Ray starts workers at a low priority (nice 15); the replay client and the server it
        # starts would then lose the CPU to everything else and the client's send lag would
        # distort every measurement. Back to normal priority where permitted.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, TRIAL_NICENESS)
        engine = self._take_warm(spec)
        if engine is None and self._engine_factory is not None:
            engine = self._engine_factory(spec)

        def ready(server: Any) -> None:
            _record_placement(server, Path(spec.workdir) / "placement.json")
            if spec.preload_next:
                self._warm = _prepare_next(spec)

        return run_trial(spec, isolate_client=True, engine=engine, on_engine_ready=ready)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` here, on this actor's GPUs and at the trials' priority (the quality
        gate's servers: :meth:`RayRunner.call`)."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, TRIAL_NICENESS)
        return fn()

    def _take_warm(self, spec: TrialSpec) -> Any:
        warm, self._warm = self._warm, None
        if warm is None:
            return None
        if warm.can_serve(spec.engine, spec.python):
            warm.retarget(spec.engine, Path(spec.workdir) / "engine.log", spec.startup_timeout_s)
            return warm
        warm.stop()
        return None

    def drop_warm(self) -> None:
        """Stop a prepared interpreter no trial will use."""
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.stop()

    def environment(self) -> dict[str, Any]:
        import ray

        _no_auto_init()

        return {
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }


#: How often a trial actor checks that the raylet that started it still lives.
_RAYLET_POLL_S = 1.0


def _exit_when_raylet_dies(poll_s: float = _RAYLET_POLL_S) -> None:
    """End this actor process once the raylet that started it is gone.

    Where a node's raylet dies and the machine lives, Ray does not end the node's workers: a
    trial actor lived on for minutes, reparented to init, with its vLLM server (issue 45). A
    daemon thread watches the parent process and exits hard when it changes; the engine guard
    then sees its owner die and stops the server's process group. Armed only where the parent
    is a raylet (a worker started some other way keeps its parent's lifetime as it is).
    """
    import psutil

    parent = os.getppid()
    try:
        if "raylet" not in psutil.Process(parent).name():
            return
    except psutil.Error:
        return

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(poll_s)
        log.warning("the raylet (pid %d) that started this trial actor is gone: exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="raylet-watch", daemon=True).start()


def _record_placement(server: Any, path: Path) -> None:
    """Write where the trial's healthy server runs (:func:`optimizer.engine.gpus.placement`):
    the Ray node (:func:`ray_node`), the actor's ``CUDA_VISIBLE_DEVICES`` and Ray GPU ids
    beside ``nvidia-smi``'s processes. Never fails the trial; outside an actor, with no Ray
    up, it records no Ray GPU ids and no node and starts no Ray."""
    import json

    from optimizer.engine.gpus import placement
    from optimizer.engine.process import group_alive_pids

    try:
        import ray

        _no_auto_init()
        pgid = getattr(server, "pgid", None)
        pids = group_alive_pids(pgid) if pgid is not None else []
        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        doc = {**ray_node(), **placement(pids, os.environ, gpu_ids)}
        doc["server_pids"] = pids
        path.write_text(json.dumps(doc, indent=2) + "\n")
    except Exception as exc:  # a record, not a measurement: the trial goes on
        with contextlib.suppress(OSError):
            path.write_text(json.dumps({"error": repr(exc)}) + "\n")


def ray_node() -> dict[str, str | None]:
    """This process's Ray node as Ray reports it: ``node_id``, ``node_ip`` (the address its
    raylet registered) and ``node_hostname``; None for each without a Ray up here."""
    import ray

    _no_auto_init()
    if not ray.is_initialized():
        return {"node_id": None, "node_ip": None, "node_hostname": None}
    node_id: str = ray.get_runtime_context().get_node_id()
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    me = next((n for n in nodes if n.get("NodeID") == node_id), {})
    return {
        "node_id": node_id,
        "node_ip": me.get("NodeManagerAddress"),
        "node_hostname": me.get("NodeManagerHostname"),
    }


def paths_to_see(spec: TrialSpec) -> tuple[tuple[str, str], ...]:
    """What a trial's node must see at the paths this process (the driver) uses, as
    ``(what, path)``: the trial's records folder or, where it does not exist yet, its nearest
    folder that does (the study folder, or one in it), the model where it is a path here, and
    the interpreter. The trace travels in the spec (a shaped trace is small): nothing to see."""
    workdir = folder = Path(spec.workdir)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    seen = [("the trial folder" if folder == workdir else "the study folder", str(folder))]
    if Path(spec.engine.model).exists():
        seen.append(("the model", spec.engine.model))
    if spec.python and Path(spec.python).exists():
        seen.append(("the interpreter", spec.python))
    return tuple(seen)


def check_node_sees(spec: TrialSpec, must_see: tuple[tuple[str, str], ...]) -> None:
    """Raise, before anything is started or written, when this node does not see a path of
    ``must_see`` (:func:`paths_to_see`).

    Raises:
        ConfigError: Naming each missing path and the node (Ray's node IP, hostname, id).
    """
    from optimizer.errors import ConfigError

    missing = [f"{what} {path}" for what, path in must_see if not os.path.exists(path)]
    if not missing:
        return
    node = ray_node()
    where = (
        f"Ray node {node['node_ip']} ({node['node_hostname']}, node id {node['node_id']})"
        if node["node_id"]
        else f"{socket.gethostname()} (no Ray)"
    )
    raise ConfigError(
        f"trial {spec.number} landed on {where}, which does not see "
        + " nor ".join(missing)
        + ": every node of the cluster must see the study folder, the model and the "
        "interpreter at the paths the driver uses (a shared filesystem, or the same volumes "
        "mounted at the same paths); nothing was started or written there"
    )


def _plain_errors(
    future: concurrent.futures.Future[TrialResult],
) -> concurrent.futures.Future[TrialResult]:
    """``future`` with the tuner's own errors raised in an actor as themselves (Ray wraps
    them in a ``RayTaskError`` that prints the actor's traceback); other errors as Ray's."""
    from optimizer.errors import AutotuneError

    out: concurrent.futures.Future[TrialResult] = concurrent.futures.Future()

    def relay(done: concurrent.futures.Future[TrialResult]) -> None:
        if done.cancelled():
            out.cancel()
            return
        exc = done.exception()
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by a caller
            if exc is None:
                out.set_result(done.result())
            else:
                cause = getattr(exc, "cause", None)
                out.set_exception(cause if isinstance(cause, AutotuneError) else exc)

    future.add_done_callback(relay)
    return out


def _node_lost_errors(
    future: concurrent.futures.Future[TrialResult], node_ref: Any
) -> concurrent.futures.Future[TrialResult]:
    """``future`` with an actor death on a node that died raised as :class:`TrialNodeLost`
    (:func:`lost_node`); every other outcome as it came. Decided off Ray's callback thread:
    asking the cluster may block."""
    out: concurrent.futures.Future[TrialResult] = concurrent.futures.Future()
    # The node's id kept as soon as the actor says it, before any death can hide it.
    said: list[str] = []

    def keep(done: concurrent.futures.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            said.append(str(done.result() or ""))

    node_ref.future().add_done_callback(keep)

    def judge(exc: BaseException) -> None:
        lost = lost_node(exc, said[0] if said and said[0] else node_ref)
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            out.set_exception(exc if lost is None else lost)

    def relay(done: concurrent.futures.Future[TrialResult]) -> None:
        if done.cancelled():
            out.cancel()
            return
        exc = done.exception()
        if exc is None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                out.set_result(done.result())
            return
        threading.Thread(target=judge, args=(exc,), name="node-lost", daemon=True).start()

    future.add_done_callback(relay)
    return out


#: How long an actor that became unreachable (``ActorUnavailableError``: its node's sockets
#: closed) may wait for the cluster to decide whether its node is dead: Ray marks a silent node
#: dead after its health checks fail (about 15-30 s by default).
NODE_VERDICT_S = 90.0


def lost_node(
    exc: BaseException, node_ref: Any, timeout_s: float = 10.0, verdict_s: float = NODE_VERDICT_S
) -> Any:
    """A :class:`~optimizer.errors.TrialNodeLost` when ``exc`` is a trial actor's death on a
    node the cluster no longer has alive, None otherwise (a death on a live node, such as a
    kill for memory, is the trial's own failure). The node is the one the actor said it ran
    on (``node_ref``); an actor that died before it could say is lost with its node when
    Ray's message says so. ``node_ref`` may be the node's id itself, once known.

    A node taken away whole first shows as an unreachable actor while the cluster still
    lists the node alive: for an ``ActorUnavailableError`` the cluster's verdict on the node
    is awaited (at most ``verdict_s``)."""
    import ray

    from optimizer.errors import TrialNodeLost

    _no_auto_init()

    if not isinstance(exc, ray.exceptions.RayActorError):
        return None
    node_id = node_ref if isinstance(node_ref, str) else ""
    if not node_id:
        with contextlib.suppress(Exception):
            node_id = str(ray.get(node_ref, timeout=timeout_s) or "")
    unreachable = isinstance(exc, ray.exceptions.ActorUnavailableError)
    deadline = time.monotonic() + (verdict_s if unreachable and node_id else 0.0)
    while True:
        try:
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
        except Exception:
            return None  # the cluster does not answer: the driver's own loss, judged elsewhere
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        if not node_id or node_id not in alive or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if node_id:
        if node_id in alive:
            return None
        where = next((n.get("NodeManagerAddress", "") for n in nodes if n["NodeID"] == node_id), "")
        return TrialNodeLost(
            f"the trial's Ray node {where or '?'} (node id {node_id}) died under it: {first}",
            node_id,
        )
    if _NODE_DEATH.search(str(exc)):
        return TrialNodeLost(f"the trial's Ray node died under it: {first}")
    return None


#: Ray's words for an actor that died with its node ("The actor died because its node has
#: died", "the actor's node was terminated unexpectedly: health check failed ...").
_NODE_DEATH = re.compile(r"\bnode\b[^.\n]*\b(has died|died|is dead|was terminated)\b", re.I)


def _prepare_next(spec: TrialSpec) -> Any:
    """A preloaded interpreter with ``spec``'s environment for the next trial (None when it
    cannot be launched: the next trial then starts from scratch)."""
    import uuid

    from optimizer.engine.process import EngineProcess
    from optimizer.types import EngineConfig

    warm = EngineProcess(
        EngineConfig(model=spec.engine.model, args={}, env=dict(spec.engine.env)),
        log_path=Path(spec.workdir).parent / ".preload" / f"{uuid.uuid4().hex[:12]}.log",
        python=spec.python,
        startup_timeout_s=spec.startup_timeout_s,
        preload=True,
    )
    try:
        warm.prepare()
    except Exception:
        warm.stop()
        return None
    return warm


class RayRunner:
    """Trials in Ray actors, each pinned to the ``gpus`` GPUs its trial needs.

    A finished trial's actor is kept, with its GPUs, for the next trial of the same size (and
    the interpreter it prepared for it, see :class:`_TrialActor`), but only when no other
    trial is in flight: a trial waiting for GPUs must never wait on an idle actor's. A trial
    of another size first releases the idle actors.

    Args:
        address: A Ray cluster to join; None starts (or reuses) a local Ray.
        capacity: Trials at once. On a machine without GPUs this should be 1 (the CPU build
            uses every core).
        cpus_per_trial: CPU resources each actor asks for.
        reuse_actors: Keep finished trials' actors for the next trials (False: one actor
            per trial).
        engine_factory: Makes each trial's engine inside its actor (a picklable callable of
            the spec); None: a real vLLM server. Tests use fakes.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        capacity: int = 1,
        cpus_per_trial: float = 1.0,
        reuse_actors: bool = True,
        engine_factory: Callable[[TrialSpec], Any] | None = None,
    ) -> None:
        import ray

        _no_auto_init()

        self._ray = ray
        start_ray(address, log_to_driver=False)
        self.capacity = capacity
        self.cpus_per_trial = cpus_per_trial
        self.reuse_actors = reuse_actors
        self._engine_factory = engine_factory
        self._idle: list[tuple[int, Any]] = []
        self._live: set[int] = set()  # submitted, not yet released or cancelled
        self._calls: list[Any] = []  # the actors of calls in flight (close ends them)
        self._lock = threading.Lock()
        # max_concurrency 2: `environment` answers while `run` is busy.
        self._actor_cls = ray.remote(max_restarts=0, max_concurrency=2)(_TrialActor)  # type: ignore[call-overload]

    def cluster_gpus(self) -> int:
        """GPUs the Ray cluster has."""
        return cluster_gpus()

    def submit(self, spec: TrialSpec, gpus: int) -> _Handle:
        actor = self._idle_actor(gpus)
        if actor is None:
            actor = self._actor_cls.options(num_gpus=gpus, num_cpus=self.cpus_per_trial).remote(
                self._engine_factory
            )
        ref = actor.run.remote(spec, paths_to_see(spec))
        node_ref = actor.node.remote()
        handle = _Handle(
            spec, _node_lost_errors(_plain_errors(ref.future()), node_ref), actor, gpus
        )
        with self._lock:
            self._live.add(id(handle))
        return handle

    def call(self, fn: Callable[[], Any], gpus: int = 0) -> Any:
        """Run ``fn`` (picklable) in an actor of its own pinned to ``gpus`` GPUs, as a trial's
        server runs, and return what it returns: work beside the trials that starts servers of
        its own (the quality gate's), never on GPUs a trial holds. The idle trial actors are
        released first (their GPUs freed); the actor ends with the call (its servers with it).

        Raises:
            Whatever ``fn`` raised (the project's own errors as themselves), or Ray's error
            when the actor died.
        """
        for _gpus, idle in self._drop_idle():
            self._ray.kill(idle, no_restart=True)
        actor = self._actor_cls.options(num_gpus=gpus, num_cpus=self.cpus_per_trial).remote(None)
        with self._lock:
            self._calls.append(actor)
        try:
            return _plain_errors(actor.call.remote(fn).future()).result()
        finally:
            with self._lock:
                self._calls.remove(actor)
            self._ray.kill(actor, no_restart=True)

    def _drop_idle(self) -> list[tuple[int, Any]]:
        with self._lock:
            idle, self._idle = self._idle, []
        return idle

    def _idle_actor(self, gpus: int) -> Any:
        """An idle actor of this size; idle actors of other sizes are released first."""
        with self._lock:
            same = [a for g, a in self._idle if g == gpus]
            others = [a for g, a in self._idle if g != gpus]
            self._idle = [(gpus, a) for a in same[1:]]
        for actor in others:
            self._ray.kill(actor, no_restart=True)
        return same[0] if same else None

    def environment(self, handle: _Handle) -> dict[str, Any]:
        """The actor's pid and GPU assignment (for tests and logs)."""
        result: dict[str, Any] = self._ray.get(handle.actor.environment.remote())
        return result

    def cancel(self, handle: _Handle) -> None:
        # The engine guard sees its owner (the actor process) die and kills the server group.
        with self._lock:
            self._live.discard(id(handle))
        if handle.actor is not None:
            self._ray.kill(handle.actor, no_restart=True)

    def release(self, handle: _Handle) -> None:
        """A finished trial's actor: kept for the next trial of its size when it ended well,
        else killed (its GPUs freed)."""
        actor, handle.actor = handle.actor, None
        if actor is None:
            return
        ended_well = handle.future.done() and handle.future.exception() is None
        with self._lock:
            self._live.discard(id(handle))
            keep = self.reuse_actors and ended_well and not self._live
            if keep:
                self._idle.append((handle.gpus, actor))
        if not keep:
            self._ray.kill(actor, no_restart=True)

    def close(self) -> None:
        """Kill the idle actors (and the interpreters they prepared) and those of calls in
        flight (a call then raises Ray's error)."""
        with self._lock:
            calls = list(self._calls)
        for actor in calls:
            self._ray.kill(actor, no_restart=True)
        for _gpus, actor in self._drop_idle():
            self._ray.kill(actor, no_restart=True)


# --- the cluster --------------------------------------------------------------------------------

_LOOPBACK = ("127.0.0.1", "::1")
#: Ray's address that starts a new local cluster whatever the machine has registered.
_PRIVATE_CLUSTER = "local"
#: How long a cluster's GCS may take to accept a connection before it counts as not answering.
_ANSWER_TIMEOUT_S = 10.0
#: Ray's switch for multi-node clusters (on by default on Linux). Off, Ray's node address is
#: the loopback one and its servers (GCS, raylet, object manager, workers, agents) listen on
#: it only; on, Ray replaces a loopback ``_node_ip_address`` by the machine's address and its
#: gRPC servers listen on every interface.
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _single_node_ray() -> None:
    """Make the local Ray about to start a loopback-only, single-node one (Ray's own mode on
    macOS and Windows): for its processes through the environment, and for this one, which
    has read the setting already."""
    from ray._private import ray_constants

    os.environ[_RAY_CLUSTER_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(
    address: str | None = None, *, host: str | None = None, log_to_driver: bool = True
) -> None:
    """Join the cluster at ``address``, or start a private one (nothing when Ray is up already).

    Without an address the cluster is this process's own, whatever the machine has
    registered: ``ray.init()`` without one joins the cluster named in Ray's
    ``ray_current_cluster`` file (the last ``ray start`` on the machine, live or long dead) or
    ``RAY_ADDRESS``, so a study would land on someone else's cluster, or fail to start
    ("object_store_memory must not be provided"), or wait on a dead one. Ray's own ``"local"``
    address starts a new cluster always; a running one is joined only when asked (an address,
    ``auto`` included).

    Args:
        address: A Ray cluster to join (``auto``: the one the machine registered, or
            ``RAY_ADDRESS``); None starts a private one.
        host: A private cluster's address (deploy/SERVICE.md, "Limits"); a loopback one keeps
            every Ray server on loopback.
        log_to_driver: Stream workers' logs to this process.
    """
    import ray

    _no_auto_init()
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": False}
    if not log_to_driver:
        kwargs["log_to_driver"] = False
    if address:
        _check_answers(address)
        ray.init(address=address, **kwargs)
        return
    kwargs["address"] = _PRIVATE_CLUSTER
    if host is not None and host not in ("0.0.0.0", "::"):
        node_ip = "127.0.0.1" if host == "localhost" else host
        kwargs.update(_node_ip_address=node_ip, dashboard_host=node_ip)
        if node_ip in _LOOPBACK:
            _single_node_ray()
    # A small object store: trial results are records, not tensors. The cluster is this
    # process's own, for one study: Ray's notice about token authentication is not the user's.
    # Its metrics have no reader (no dashboard), and Ray 2.60's OpenTelemetry exporter thread
    # once killed a tune driver with SIGSEGV (TemporalMetricStorage::buildMetrics) on a loaded
    # machine: a local cluster records none.
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth.level
    auth.setLevel(logging.ERROR)
    try:
        ray.init(
            object_store_memory=256 * 1024**2,
            _system_config={"enable_metrics_collection": False},
            **kwargs,
        )
    finally:
        auth.setLevel(level)


def _check_answers(address: str) -> None:
    """A clear error, at once, when no Ray cluster answers at ``address`` (``auto``: the one
    the machine registered, or ``RAY_ADDRESS``): ``ray.init`` would wait on a dead cluster's
    GCS for minutes, saying nothing. Ray client addresses (``ray://``) are left to Ray."""
    from ray._private.services import canonicalize_bootstrap_address

    from optimizer.errors import ConfigError

    if "://" in address:
        return
    try:
        found = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as exc:
        raise ConfigError(f"Ray address {address!r}: {exc}") from None
    host, _, port = (found or "").rpartition(":")
    if not host or not port.isdigit() or "://" in host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), _ANSWER_TIMEOUT_S):
            pass
    except OSError as exc:
        named = address if found == address else f"{address!r}, which names {found}"
        raise ConfigError(
            f"no Ray cluster answers at {named} ({exc.strerror or exc}): start it, or give the "
            "address of a running one; without --ray-address the tuner starts a cluster of its "
            "own"
        ) from None


def cluster_gpus() -> int:
    """GPUs the Ray cluster has."""
    import ray

    _no_auto_init()

    resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    return int(resources.get("GPU", 0))


def own_node_alive(timeout_s: float) -> bool:
    """Whether the cluster answers, within ``timeout_s``, that this process's node is alive."""
    import ray

    _no_auto_init()

    answer: list[bool] = []

    def ask() -> None:
        with contextlib.suppress(Exception):
            me = ray.get_runtime_context().get_node_id()
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
            answer.append(any(n["NodeID"] == me and n["Alive"] for n in nodes))

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(answer and answer[0])


class ClusterLossGuard:
    """A runner wrapper: a trial lost because the cluster went away is not a result.

    When a trial's actor dies and the driver did not cancel it, the driver asks the cluster
    whether its own node is still alive. If it is not (or the cluster does not answer), the
    driver exits at once without telling the trial, exactly as a killed driver would: the
    trial stays RUNNING and the next driver fails and re-queues it. A trial actor that died on
    a healthy cluster (e.g. killed for memory) is a trial failure, passed on as such.
    """

    def __init__(self, inner: Any, cancelling: Callable[[], bool]) -> None:
        self.inner = inner
        self.capacity = inner.capacity
        self._cancelling = cancelling

    def submit(self, spec: Any, gpus: int) -> Any:
        handle = self.inner.submit(spec, gpus)
        relayed: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def relay(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            if exc is None:
                relayed.set_result(fut.result())
                return
            # Decide off Ray's callback thread: the health check may block.
            threading.Thread(target=self._judge, args=(exc, relayed), daemon=True).start()

        handle.future.add_done_callback(relay)
        handle.future = relayed
        return handle

    def _judge(self, exc: BaseException, out: Any) -> None:
        import ray

        _no_auto_init()

        from optimizer.errors import TrialNodeLost

        if (
            isinstance(exc, ray.exceptions.RayActorError | TrialNodeLost)
            and not self._cancelling()
            and not own_node_alive(timeout_s=15.0)
        ):
            os._exit(1)
        out.set_exception(exc)

    def cancel(self, handle: Any) -> None:
        self.inner.cancel(handle)

    def call(self, fn: Callable[[], Any], gpus: int = 0) -> Any:
        """The inner runner's ``call`` (:meth:`RayRunner.call`); here where it has none."""
        call = getattr(self.inner, "call", None)
        return fn() if call is None else call(fn, gpus)

    def release(self, handle: Any) -> None:
        release = getattr(self.inner, "release", None)
        if release is not None:
            release(handle)

    def close(self) -> None:
        self.inner.close()


class DetachedActors:
    """Named, detached actors of one class in one namespace (the service's study drivers).

    Detached, so a restart of the process that started them finds them by name and keeps
    them. Each asks for no CPU: it waits on its trials and must not hold the CPU a trial needs.

    Args:
        cls: The actor's class.
        namespace: Ray namespace of the names.
        max_concurrency: Calls served at once (status and cancel answer while a thread runs).
    """

    def __init__(self, cls: type, namespace: str, *, max_concurrency: int = 4) -> None:
        import ray

        _no_auto_init()

        self._ray = ray
        self._namespace = namespace
        self._cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency, max_restarts=0)(cls)  # type: ignore[call-overload]

    def _actor(self, name: str) -> Any:
        try:
            return self._ray.get_actor(name, namespace=self._namespace)
        except ValueError:
            return None

    def start(self, name: str, *args: Any) -> None:
        """Start the actor ``name`` (nothing when it exists)."""
        self._cls.options(
            name=name, namespace=self._namespace, lifetime="detached", get_if_exists=True
        ).remote(*args)

    def call(self, name: str, method: str, timeout_s: float = 60.0) -> Any:
        """The result of ``method()`` on actor ``name``.

        Raises:
            LookupError: No such actor, or it died.
            TimeoutError: It did not answer in time.
        """
        actor = self._actor(name)
        if actor is None:
            raise LookupError(name)
        try:
            return self._ray.get(getattr(actor, method).remote(), timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"{name}.{method} did not answer in {timeout_s:g} s") from exc
        except self._ray.exceptions.RayActorError as exc:
            raise LookupError(name) from exc

    def kill(self, name: str) -> None:
        """End the actor ``name`` (nothing when there is none)."""
        actor = self._actor(name)
        if actor is not None:
            self._ray.kill(actor, no_restart=True)
