"""What the engine prints: the start-up line, the per-step progress line, the summary lines, and monitor
events. The round modes describe their rounds; a mode with an outer loop is described by the loop's own
``banner``, ``progress`` and ``report`` (``runtime.outer.interface``), printed as they are."""

import torch.distributed as tdist

from ..runtime.rounds.job import CommResult
from ..runtime.rounds.stats import round_stats, round_words


def _report_commit(engine, result: CommResult) -> None:
    """DeepSpeed's progress line and monitor events, with the mode's own figures."""
    opt = engine.optimizer
    if engine.steps_per_print() and engine.global_steps % engine.steps_per_print() == 0:
        engine._report_progress(engine.global_steps)
        _say(f"ACCO step={engine.global_steps}: {opt.outer.progress() or round_words(round_stats(opt))}")
    if engine.monitor.enabled and engine.global_rank == 0:
        s = round_stats(opt)
        events = [("Train/Samples/acco_global_micro_batches", result.global_micro, engine.global_samples),
                  ("Train/Samples/acco_comm_s", result.comm_s, engine.global_samples),
                  ("Train/Samples/acco_wait_s_total", s["wait_s"], engine.global_samples)]
        engine.monitor.write_events(events)


def _say(msg: str) -> None:
    """One line on rank 0 at the default log level (DeepSpeed's rank processes log at WARNING)."""
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        print(f"[acco_ds] {msg}", flush=True)
