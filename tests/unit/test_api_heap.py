"""The API replica's heap out of the garbage collector's reach once it is built (issue 42):
a full collection then walks only what requests make. Its effect on ``/healthz`` is measured
in benchmarks/service_load.py; here, that the objects alive at build time are frozen and
leave a collection's walk, and that the replica's app is built through it."""

from __future__ import annotations

import gc
import inspect

from optimizer.service import api


def test_freezing_takes_the_imports_out_of_every_collection() -> None:
    before = len(gc.get_objects())
    try:
        frozen = api.freeze_heap()
        walked = len(gc.get_objects())
    finally:
        gc.unfreeze()
    assert frozen >= 0.9 * before, (frozen, before)
    assert walked < 0.1 * before, (walked, before)


def test_the_replica_freezes_its_heap_once_its_app_is_built() -> None:
    source = inspect.getsource(api._Ingress.__serve_build_asgi_app__)
    assert source.index("create_app(") < source.index("freeze_heap()")
