"""The communication side: one background thread that runs one job at a time.

A job is a plain function (reduce-scatter, sharded optimizer update,
all-gather) submitted by the compute side at the start of a round. The
thread owns

* its own process group, so its collectives never interleave with the
  collectives DeepSpeed or the user issue from the main thread (two threads on
  one group would deadlock or mix up messages);
* on CUDA, its own stream, ordered after the compute stream by an event at
  submission, and an event at the end that the compute stream waits on before
  it uses the results.

Errors raised in the job are re-raised on the main thread by ``wait()``. A
rank that dies makes its peers' collectives fail (gloo: connection closed;
NCCL: the group timeout), so every rank gets an error instead of a hang.
"""

import atexit
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from . import lifetime


class CommWorker:
    """Runs communication jobs on a side thread.

    Args:
        ranks: global ranks of the group the jobs communicate in.
        device: the compute device; a CUDA device gets a side stream.
        timeout_s: timeout of the side process group; ``wait()`` gives up a
            little after it.
        group: that side group, if the caller created it (else it is created here).
    """

    def __init__(self, ranks, device: torch.device, timeout_s: float = 1800.0, group=None):
        self.ranks = list(ranks)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        # Collective: every rank of the job must create it in the same order. A caller that splits the
        # ranks into subgroups creates them all (new_subgroups_by_enumeration) and passes its own.
        self.group = group if group is not None else lifetime.new_group(self.ranks, timedelta(seconds=self.timeout_s))
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._ready_event = None
        self._done_event = None
        self._jobs: "queue.Queue[Optional[Callable[[], Any]]]" = queue.Queue()
        self._finished = threading.Event()
        self._finished.set()
        self._busy = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="acco-comm", daemon=True)
        self._thread.start()
        # Join the thread at interpreter exit even if the engine is never destroyed.
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() is not None) and ref().close()
        atexit.register(self._atexit)

    @property
    def busy(self) -> bool:
        """A job was submitted and its result not yet collected by ``wait()``."""
        return self._busy

    def _loop(self):
        # The side thread has its own autograd mode and (on CUDA) its own stream.
        with torch.no_grad():
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    if self.cuda:
                        with torch.cuda.stream(self.stream):
                            self.stream.wait_event(self._ready_event)
                            self._result = job()
                            self._done_event = torch.cuda.Event()
                            self._done_event.record(self.stream)
                            # The job is "done" for adaptive accumulation when the GPU is done.
                            self._done_event.synchronize()
                    else:
                        self._result = job()
                except BaseException as err:  # re-raised on the main thread
                    self._error = err
                finally:
                    self._finished.set()

    def submit(self, job: Callable[[], Any]) -> None:
        if self._busy:
            raise RuntimeError("ACCO internal error: a communication job is already in flight")
        if not self._thread.is_alive():
            raise RuntimeError("ACCO communication thread is not running (engine destroyed?)")
        if self.cuda:
            # The job reads buffers the compute stream wrote: order it after them.
            self._ready_event = torch.cuda.Event()
            self._ready_event.record(torch.cuda.current_stream(self.device))
        self._busy = True
        self._finished.clear()
        self._error = None
        self._jobs.put(job)

    def done(self) -> bool:
        """Non-blocking: has the in-flight job finished (or is there none)?"""
        return self._finished.is_set()

    def wait(self) -> Any:
        """Block until the in-flight job finished; return its result or raise its error."""
        if not self._busy:
            return None
        # The group's own timeout fires first; this is a last resort against a wedged thread.
        if not self._finished.wait(timeout=self.timeout_s + 60.0):
            raise RuntimeError(f"ACCO communication did not finish within {self.timeout_s + 60:.0f} s; another "
                               f"rank has probably failed or stopped calling backward(): check the other ranks' logs")
        self._busy = False
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"ACCO communication failed on this rank: {type(err).__name__}: {err}. Another rank "
                               f"has probably died, hung or lost its network (a hang is detected after "
                               f"acco.timeout_s = {self.timeout_s:g} s): check the other ranks' logs, then relaunch "
                               f"and load_checkpoint") from err
        if self.cuda and self._done_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done_event)
        result, self._result = self._result, None
        return result

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (after the in-flight job, if it finishes in time)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive() and self.group is not None and dist.is_initialized():
            # Free the side group now rather than during interpreter teardown, where gloo's
            # threads may be destroyed out of order (std::terminate).
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.group = None
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
