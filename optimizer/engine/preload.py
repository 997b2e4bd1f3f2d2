"""A server's interpreter started ahead of its command line: vLLM imported, waiting to serve.

``EngineProcess(preload=True).prepare()`` runs ``python -m optimizer.engine.preload GO MODULE``
under the guard (same process group, same environment as the server itself would get). It
imports ``MODULE`` (vLLM's OpenAI server module: vLLM, torch, transformers, FastAPI; no CUDA is
initialised by importing), writes ``GO.ready``, and waits for the file ``GO``, which holds the
server's arguments as JSON. Then it runs ``MODULE`` as ``__main__`` with those arguments,
exactly as ``python -m MODULE ARGS`` would, minus the imports it already did.

What this changes is when the imports happen, not what is served: the same interpreter, the
same modules, the same environment, the same arguments. The imports can then overlap other
work (the previous trial's replay), which is the cut issue 16 measures.

Stdlib only until ``MODULE`` is imported.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
from pathlib import Path

__all__ = ["main"]

_POLL_S = 0.01


def main(argv: list[str] | None = None) -> int:
    """Import, announce readiness, wait for the arguments, run the server module."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    go, module = Path(args[0]), args[1]
    sys.argv = [module]  # nothing of the preload's own command line is seen by the import
    importlib.import_module(module)
    ready = go.with_name(go.name + ".ready")
    ready.write_text(str(os.getpid()))
    while not go.exists():
        time.sleep(_POLL_S)
    doc = json.loads(go.read_text())
    sys.argv = [module, *doc["args"]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
