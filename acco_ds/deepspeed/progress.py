"""What the engine prints: the start-up line, the per-step progress line, the summary lines, and monitor
events. The round modes describe their rounds; a mode with an outer loop is described by the loop's own
``banner``, ``progress`` and ``report`` (``runtime.outer_loop``), printed as they are."""

from typing import List, Tuple

import torch.distributed as tdist

from ..runtime.compression import describe
from ..runtime.dtypes import dtype_name
from ..runtime.job import CommResult


def _banner(acco, opt) -> str:
    """The one start-up line rank 0 prints."""
    outer = opt.outer.banner()
    if outer:  # inner steps are plain ZeRO-1 steps of gradient_accumulation_steps micro-batches
        words = f"{outer} inner=ZeRO-1 step of {opt.schedule.min_micro} micro-batches/rank"
    else:
        words = (f"accumulation={acco.accumulation} micro-batches/round={opt.schedule.min_micro}"
                 f"{'' if opt.schedule.max_micro == opt.schedule.min_micro else f'..{opt.schedule.max_micro}'} "
                 f"world_size={opt.world_size}")
    words += f" collectives={opt.layout or 'flat'} compression=[{_compression(acco, opt)}]"
    return (f"ACCO engine: mode={acco.mode} {words} model={dtype_name(opt.dtype)} "
            f"grad_accum={dtype_name(opt.accum_dtype)} communication={dtype_name(opt.comm_dtype)} "
            f"kernels={opt.kernels.name} update={opt.update.name} "
            f"extra buffers={opt.buffer_bytes()['total'] / 2**20:.1f} MiB/rank")


def _compression(acco, opt) -> str:
    outer = opt.outer.stats().get("outer_compression") is not None
    return describe(acco.compression, acco.local, rounds=opt.codec is not None, outer=outer)


def _round_words(s: dict) -> str:
    hidden = s["hidden_comm_fraction"]
    return (f"rounds={s['rounds']} micro-batches/round={s['mean_micro_per_round']:.2f} "
            f"compute={s['compute_s']:.2f}s comm={s['comm_s']:.2f}s waited={s['wait_s']:.2f}s "
            f"hidden={'n/a' if hidden is None else f'{100 * hidden:.0f}%'}")


def report_lines(opt) -> List[Tuple[str, str]]:
    """The mode's lines of a run summary, ``(label, text)``: an outer loop's own, or ACCO's rounds."""
    outer = opt.outer.report()
    s = opt.log.summary()
    lines = [] if opt.codec is None else [
        ("compression", f"rounds {opt.codec}: {opt.codec.sent_bytes / 2**20:.2f} MiB sent by this rank "
                        f"(payload, scales included)")]
    if outer:
        inner = (f"{s['rounds']} inner steps on this rank, ZeRO-1 communication {s['comm_s']:.2f} s "
                 f"(not overlapped); kernels={opt.kernels.name}, update={opt.update.name}")
        return [("inner steps", inner)] + lines + outer
    hidden = "n/a" if s["hidden_comm_fraction"] is None else f"{100 * s['hidden_comm_fraction']:.0f}%"
    return [("ACCO rounds", f"{s['rounds']} rounds, {s['mean_micro_per_round'] or 0:.2f} micro-batches/round, "
                            f"communication {s['comm_s']:.2f} s of which {hidden} hidden behind compute "
                            f"(compute waited {s['wait_s']:.2f} s); kernels={opt.kernels.name}, "
                            f"update={opt.update.name}")] + lines


def _report_commit(engine, result: CommResult) -> None:
    """DeepSpeed's progress line and monitor events, with the mode's own figures."""
    opt = engine.optimizer
    if engine.steps_per_print() and engine.global_steps % engine.steps_per_print() == 0:
        engine._report_progress(engine.global_steps)
        _say(f"ACCO step={engine.global_steps}: {opt.outer.progress() or _round_words(opt.round_stats())}")
    if engine.monitor.enabled and engine.global_rank == 0:
        s = opt.round_stats()
        events = [("Train/Samples/acco_global_micro_batches", result.global_micro, engine.global_samples),
                  ("Train/Samples/acco_comm_s", result.comm_s, engine.global_samples),
                  ("Train/Samples/acco_wait_s_total", s["wait_s"], engine.global_samples)]
        engine.monitor.write_events(events)


def _say(msg: str) -> None:
    """One line on rank 0 at the default log level (DeepSpeed's rank processes log at WARNING)."""
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        print(f"[acco_ds] {msg}", flush=True)
