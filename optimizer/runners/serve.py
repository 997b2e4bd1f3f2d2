"""The service's Ray Serve application: one replica of the API's FastAPI ingress
(:func:`serve_deployment`), run on HTTP (:func:`serve_run`) with its request path at the
trials' CPU priority (:func:`serve_api_priority`), and stopped (:func:`serve_shutdown`)."""

from __future__ import annotations

import logging
from typing import Any

from optimizer.runners.base import TRIAL_NICENESS, WORKER_NICENESS_ENV
from optimizer.runners.base import no_auto_init as _no_auto_init

__all__ = ["serve_api_priority", "serve_deployment", "serve_run", "serve_shutdown"]

#: Serve's actors on the API's request path, found by name in Serve's namespace: its proxies
#: (``SERVE_PROXY_ACTOR-<node>``: every request passes through one) and an application's
#: replicas (``SERVE_REPLICA::<app>#<deployment>#<id>``).
_SERVE_NAMESPACE = "serve"
_SERVE_PROXY_PREFIX = "SERVE_PROXY_ACTOR"
_SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"

log = logging.getLogger(__name__)


def serve_deployment(ingress: type, name: str, *args: Any, max_ongoing_requests: int = 64) -> Any:
    """A one-replica Serve application of a FastAPI ingress class, bound to ``args``.

    The replica asks for no CPU, so it never holds one a trial needs, and starts at the trial
    actors' priority (:data:`TRIAL_NICENESS`), not Ray's low default for workers: an API that
    waits behind the trials' servers answered ``/healthz`` in a p95 of 580 ms (issue 42). It
    takes ``max_ongoing_requests`` requests at once; Serve's proxy queues the rest.
    """
    from ray import serve

    deployment = serve.deployment(
        name=name,
        num_replicas=1,
        ray_actor_options={
            "num_cpus": 0,
            "runtime_env": {"env_vars": {WORKER_NICENESS_ENV: str(TRIAL_NICENESS)}},
        },
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=10,
    )(serve.ingress()(ingress))
    return deployment.bind(*args)


def serve_run(app: Any, *, name: str, host: str, port: int) -> None:
    """Run a Serve application on HTTP ``host:port`` (Ray must be up), its request path at the
    trials' priority where permitted (:func:`serve_api_priority`; a warning where not)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix="/", blocking=False)
    for actor, seen in serve_api_priority(name, TRIAL_NICENESS).items():
        if seen["refused"] is not None:
            log.warning(
                "%s (pid %s, nice %s) not raised to the trials' nice %d: %s (raising a "
                "priority needs root or CAP_SYS_NICE; deploy/SERVICE.md, 'Slow clients')",
                actor,
                seen["pid"],
                seen["nice"],
                TRIAL_NICENESS,
                seen["refused"],
            )


def serve_api_priority(app: str, niceness: int | None = None) -> dict[str, dict[str, Any]]:
    """Serve's proxies and ``app``'s replicas, each raised to ``niceness`` where it is lower in
    priority (None: only read): by actor name, its ``pid``, ``nice`` (the highest niceness of
    its threads, after) and ``refused`` (why it could not be raised, else None).

    Serve's controller starts its proxies at Ray's worker niceness (15), and Serve has no
    option to start them otherwise in the Ray versions this project takes (Ray 2.60's
    ``ControllerOptions`` sets the controller's environment only, alpha, and only when Serve
    first starts), so each actor is reniced after the fact, from inside its own process
    (``__ray_call__``, on whichever node it runs): each of its threads, as Linux keeps a
    niceness per thread and a thread started later takes its starter's. Raising a priority
    needs root or CAP_SYS_NICE; without either, ``refused`` says so and nothing changes. The
    actors are found by name (:func:`ray.util.list_named_actors`): Ray's state API needs the
    dashboard, which :func:`start_ray` leaves off. A proxy Serve restarts later starts at 15
    again.
    """
    import ray

    _no_auto_init()

    def renice(_actor: Any, to: int | None) -> dict[str, Any]:
        # Runs in the actor's process (a local function: pickled by value, imports nothing).
        import os

        pid = os.getpid()
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # not Linux: one niceness for the process
            tids = [0]
        refused, seen = None, []
        for tid in tids:
            try:
                if to is not None and os.getpriority(os.PRIO_PROCESS, tid) > to:
                    os.setpriority(os.PRIO_PROCESS, tid, to)
                seen.append(os.getpriority(os.PRIO_PROCESS, tid))
            except ProcessLookupError:  # the thread ended
                continue
            except PermissionError as exc:
                refused = exc.strerror or str(exc)
                seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        return {"pid": pid, "nice": max(seen, default=None), "refused": refused}

    found: dict[str, dict[str, Any]] = {}
    if not ray.is_initialized():  # Ray's listing would start a cluster of its own
        return found
    for entry in ray.util.list_named_actors(all_namespaces=True):
        actor, namespace = entry["name"], entry["namespace"]
        ours = actor.startswith(_SERVE_PROXY_PREFIX) or actor.startswith(
            f"{_SERVE_REPLICA_PREFIX}{app}#"
        )
        if namespace != _SERVE_NAMESPACE or not ours:
            continue
        try:
            handle: Any = ray.get_actor(actor, namespace=namespace)
            seen: dict[str, Any] = ray.get(handle.__ray_call__.remote(renice, niceness), timeout=30)
            found[actor] = seen
        except (ValueError, ray.exceptions.RayError) as exc:  # gone, or not answering
            found[actor] = {"pid": None, "nice": None, "refused": f"{type(exc).__name__}"}
    return found


def serve_shutdown() -> None:
    """Stop Serve and its applications."""
    from ray import serve

    serve.shutdown()  # type: ignore[no-untyped-call]
