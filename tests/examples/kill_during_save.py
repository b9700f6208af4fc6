"""The wrapper the kill-and-resume tests run a training script through: it patches orbax in
the child process only and SIGKILLs it after the save of step K (`between`, once that
save is complete) or inside the save of step K, after its files are written and before
orbax commits it (`during`: orbax's `_finalize`, which renames the temporary directory).

    python -c KILLER MODE K script.py [script args]
"""

KILLER = r"""
import os, runpy, signal, sys
import orbax.checkpoint as ocp
mode, at = sys.argv[1], int(sys.argv[2])
sys.argv = [sys.argv[3]] + sys.argv[4:]
save, finalize = ocp.CheckpointManager.save, ocp.CheckpointManager._finalize

def patched_save(self, step, *args, **kwargs):
    out = save(self, step, *args, **kwargs)
    if mode == "between" and step == at:
        self.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    return out

def patched_finalize(self, step, *args, **kwargs):
    if mode == "during" and step == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return finalize(self, step, *args, **kwargs)

ocp.CheckpointManager.save, ocp.CheckpointManager._finalize = patched_save, patched_finalize
runpy.run_path(sys.argv[0], run_name="__main__")
"""
