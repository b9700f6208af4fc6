"""The wrapper the kill-and-resume tests run a training script through: it patches orbax in
the child process only and SIGKILLs it after the save of step K (`between`, once that
save is complete) or inside the save of step K, after its files are written and before
orbax commits it (`during`).

`during` hooks the background thread of orbax's async checkpointer, which waits for the
step's writes (with several processes, then for the others' at a barrier) and then
renames the temporary directory (checked with orbax-checkpoint 0.12.8): each process dies
once every process's files are written, so the temporary directory is always there and
never renamed. (Killing when `CheckpointManager._finalize` starts raced the
writes: on a busy machine the process could die before the directory existed.)

    python -c KILLER MODE K script.py [script args]
"""

KILLER = r"""
import os, runpy, signal, sys
import orbax.checkpoint as ocp
mode, at = sys.argv[1], int(sys.argv[2])
sys.argv = [sys.argv[3]] + sys.argv[4:]
from orbax.checkpoint._src.checkpointers import async_checkpointer as ac
save, wait_for_commit = ocp.CheckpointManager.save, ac._background_wait_for_commit_futures

def patched_save(self, step, *args, **kwargs):
    out = save(self, step, *args, **kwargs)
    if mode == "between" and step == at:
        self.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    return out

def patched_wait_for_commit(directory, commit_futures, on_commit_callback, *, sync_fn, **kw):
    if mode == "during" and directory.name == str(at):
        def die(*_):
            os.kill(os.getpid(), signal.SIGKILL)

        def sync_then_die(key, timeout_ms, barrier=sync_fn):  # every process's files written
            barrier(key, timeout_ms)
            die()

        # Alone, the commit follows this process's writes; with several, the first barrier.
        on_commit_callback, sync_fn = die, sync_then_die
    return wait_for_commit(directory, commit_futures, on_commit_callback, sync_fn=sync_fn, **kw)

ocp.CheckpointManager.save = patched_save
ac._background_wait_for_commit_futures = patched_wait_for_commit
runpy.run_path(sys.argv[0], run_name="__main__")
"""
