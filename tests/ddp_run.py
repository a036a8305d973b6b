"""One two-rank DDP launch (CPU, gloo) that runs several scenarios of the helper scripts one after another, so that
the tests pay for starting two interpreters and a process group once, not once a scenario. Run by
``conftest.ddp_scenarios``.

Usage: python ddp_run.py OUT_DIR SCRIPT:SCENARIO [SCRIPT:SCENARIO ...]

SCRIPT is a helper module here (``ddp_spill_run``, ``ddp_tuner_run``, ...) with a ``run(out_dir, scenario)``; each
scenario writes its results under OUT_DIR/SCRIPT/SCENARIO/, as the script alone writes them under its OUT_DIR. A
scenario that raises on a rank leaves that rank's traceback there in ``crash-rank<N>.txt``; the next one still runs.
A last spec ending in ``!`` is let raise: the launch then ends as that script run alone would (its error, its exit
code), for a scenario whose test checks how the launch ends.
Lightning's launcher starts rank 1 with the same arguments, so both ranks run the same scenarios in the same order.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's package


def _imported(script: str):
    """The helper script's module. What its first import brings in lives for the launch: it is kept out of the
    garbage collector's full passes (the tuners' trials ask for one after each search), which then take a fraction
    of their time (as in conftest.py)."""
    if script not in sys.modules:
        importlib.import_module(script)
        gc.collect()
        gc.freeze()
    return sys.modules[script]


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for i, spec in enumerate(specs):
        raises = spec.endswith("!")
        assert not raises or i == len(specs) - 1, "only the last scenario may end the launch"
        script, scenario = spec.rstrip("!").split(":", 1)
        folder = os.path.join(out, script, scenario)
        os.makedirs(folder, exist_ok=True)
        print(f"[ddp_run] rank {rank}: {spec}", file=sys.stderr, flush=True)  # where a hang left the launch
        started = time.perf_counter()
        if raises:
            _imported(script).run(folder, scenario)
            return
        try:
            _imported(script).run(folder, scenario)
        except Exception:
            with open(os.path.join(folder, f"crash-rank{rank}.txt"), "w", encoding="utf-8") as f:
                f.write(traceback.format_exc())
            traceback.print_exc()
        print(f"[ddp_run] rank {rank}: {spec} took {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
