"""Pure schedules: which collective runs when, on which buffers, with which
update. No tensors, no threads, no DeepSpeed."""

from .rounds import COMMIT, DELAYED, ESTIMATE, PEEK, REAL, STARTUP, SYNC, Round, RoundSchedule

__all__ = ["Round", "RoundSchedule", "STARTUP", "ESTIMATE", "REAL", "DELAYED", "SYNC", "PEEK", "COMMIT"]
