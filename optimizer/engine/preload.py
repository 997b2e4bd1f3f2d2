"""A server's interpreter started ahead of its command line: vLLM imported, waiting to serve.

``EngineProcess(preload=True).prepare()`` runs ``python -m optimizer.engine.preload GO MODULE
[EXTRA ...]`` under the guard (same process group, same environment as the server itself
would get). It imports ``MODULE`` (vLLM's OpenAI server module: vLLM, torch, transformers,
FastAPI; no CUDA is initialised by importing) and the ``EXTRA`` modules the engine core needs
once vLLM forks it from this process (best effort: one that does not import is skipped),
writes ``GO.ready`` (pid, import seconds, the extras imported, whether CUDA got initialised),
and waits for the file ``GO``, which holds the server's arguments as JSON (and the log file
its output goes to from then on, when it differs). Then it runs
``MODULE`` as ``__main__`` with those arguments,
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
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    go, module, extras = Path(args[0]), args[1], args[2:]
    sys.argv = [module]  # nothing of the preload's own command line is seen by the import
    t0 = time.monotonic()
    importlib.import_module(module)
    imported = []
    for name in extras:
        # Modules the engine core imports after it is forked from this process; one this vLLM
        # build lacks (or cannot import here) is simply left to the engine core, as before.
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception:
            pass
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    if cuda:  # vLLM would then spawn its engine core instead of forking it: say so
        print("vllm-autotune preload: CUDA was initialised by an import", file=sys.stderr)
    ready = go.with_name(go.name + ".ready")
    ready.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "import_s": round(time.monotonic() - t0, 3),
                "extras": imported,
                "cuda_initialized": cuda,
            }
        )
    )
    while not go.exists():
        time.sleep(_POLL_S)
    doc = json.loads(go.read_text())
    if doc.get("log"):
        # The server's own log from here on: the interpreter was prepared before its trial
        # (and its folder) was known.
        fd = os.open(doc["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.argv = [module, *doc["args"]]
    try:  # ps, nvidia-smi and the tuner's own leak checks see the server's command line
        import setproctitle  # a vLLM dependency

        setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *doc["args"]]))
    except Exception:
        pass
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
