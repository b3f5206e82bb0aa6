"""What the engine prints: the start-up line and the per-step progress line, and monitor events."""

import torch.distributed as tdist

from ..runtime.dtypes import dtype_name
from ..runtime.job import CommResult


def _banner(acco, opt) -> str:
    """The one start-up line rank 0 prints."""
    extra = opt.buffer_bytes()["total"]
    timed = opt.local_sgd is not None and opt.local_sgd.schedule.timed
    line = (f"ACCO engine: mode={acco.mode}{' (A-EDiT)' if timed else ''} accumulation={acco.accumulation} "
            f"micro-batches/round={opt.schedule.min_micro}"
            f"{'' if opt.schedule.max_micro == opt.schedule.min_micro else f'..{opt.schedule.max_micro}'} "
            f"world_size={opt.world_size} model={dtype_name(opt.dtype)} "
            f"grad_accum={dtype_name(opt.accum_dtype)} communication={dtype_name(opt.comm_dtype)} "
            f"kernels={opt.kernels.name} update={opt.update.name} "
            f"extra buffers={extra / 2**20:.1f} MiB/rank")
    if opt.local_sgd is not None:
        g = opt.local_sgd.groups
        ls = opt.local_sgd
        period = f"sync_time_s={ls.sync_time_s:g}" if ls.schedule.timed else f"sync_every={ls.schedule.sync_every}"
        line += f" replicas={g.replicas}x{g.k} {period}"
    return line


def _report_commit(engine, result: CommResult) -> None:
    """DeepSpeed's progress line and monitor events, with ACCO's round figures."""
    if engine.steps_per_print() and engine.global_steps % engine.steps_per_print() == 0:
        engine._report_progress(engine.global_steps)
        s = engine.optimizer.round_stats()
        hidden = s["hidden_comm_fraction"]
        _say(f"ACCO step={engine.global_steps}: rounds={s['rounds']} "
             f"micro-batches/round={s['mean_micro_per_round']:.2f} "
             f"compute={s['compute_s']:.2f}s comm={s['comm_s']:.2f}s waited={s['wait_s']:.2f}s "
             f"hidden={'n/a' if hidden is None else f'{100 * hidden:.0f}%'}")
    if engine.monitor.enabled and engine.global_rank == 0:
        s = engine.optimizer.round_stats()
        events = [("Train/Samples/acco_global_micro_batches", result.global_micro, engine.global_samples),
                  ("Train/Samples/acco_comm_s", result.comm_s, engine.global_samples),
                  ("Train/Samples/acco_wait_s_total", s["wait_s"], engine.global_samples)]
        engine.monitor.write_events(events)


def _say(msg: str) -> None:
    """One line on rank 0 at the default log level (DeepSpeed's rank processes log at WARNING)."""
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        print(f"[acco_ds] {msg}", flush=True)
