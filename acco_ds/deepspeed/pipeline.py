"""ACCOPipelineEngine: ACCO and the local-SGD family on DeepSpeed's ``PipelineEngine``.

``train_batch()`` runs a pipeline schedule of ``gradient_accumulation_steps``
micro-batches. At pipeline size 1 every backward goes through DeepSpeed's
``backward`` and ends ACCO's rounds there, as on the plain engine. With
``num_stages >= 2`` only the last stage calls DeepSpeed's ``backward``; the
others run ``outputs.backward(grad)`` themselves, and every stage reduces at
the end of its schedule (``ReduceTiedGrads``, ``ReduceGrads``,
``OptimizerStep``). So the rounds follow the schedule:

* every stage counts each micro-batch after its own backward pass;
* ``ReduceTiedGrads`` sums the tied weights' gradients (Megatron's tied word
  embeddings on the first and the last stage) over their tied group, in ACCO's
  flat accumulator, where the backward hooks put them (``.grad`` is gone);
* ``ReduceGrads`` ends the round on the stage's data-parallel group. ``sync``
  and the local-SGD inner steps communicate and commit there; ``dpu`` hands the
  batch's gradients to the communication thread, which commits them while the
  next ``train_batch()`` runs its schedule (no extra flush);
* ``acco`` needs two rounds per step: each ``train_batch()`` runs two pipeline
  flushes of ``gradient_accumulation_steps / 2`` micro-batches, with a round
  end after each, so each half-batch's communication hides behind the other
  half's schedule. The price is a second fill and drain per step: a bubble of
  ``(p − 1) / (m/2 + p − 1)`` of the schedule instead of ``(p − 1) / (m + p − 1)``
  for ``p`` stages and ``m`` micro-batches.

The global gradient norm counts a tied weight once (ZeRO-1 skips the copies
marked ``ds_pipe_replicated``) and sums the stages' squares over the pipe
group (``deepspeed.parallel.norm_segments``).
"""

from .compat import PipelineEngine, pipe_schedule
from .engine import ACCOEngine


class TwoFlushSchedule:
    """``TrainSchedule`` twice over half the micro-batches; the first half ends with the reductions (a round
    end) but without the optimizer step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        self.halves = [pipe_schedule.TrainSchedule(micro_batches=micro_batches // 2, stages=stages,
                                                   stage_id=stage_id) for _ in range(2)]

    def num_pipe_buffers(self) -> int:
        return max(h.num_pipe_buffers() for h in self.halves)

    def __iter__(self):
        for cmds in self.halves[0]:
            yield [c for c in cmds if not isinstance(c, pipe_schedule.OptimizerStep)]
        yield from self.halves[1]


def _exec_backward_pass(self, buffer_id):
    PipelineEngine._INSTRUCTION_MAP[pipe_schedule.BackwardPass](self, buffer_id)
    if self.num_stages > 1:  # the micro-batch's gradients are in the accumulator on every stage
        self.optimizer.count_micro_batch()


def _exec_reduce_tied_grads(self):
    if self.num_stages == 1:
        return PipelineEngine._INSTRUCTION_MAP[pipe_schedule.ReduceTiedGrads](self)
    self.optimizer.reduce_tied(self.module.get_tied_weights_and_groups())


def _exec_reduce_grads(self):
    if self.num_stages == 1:  # rounds ended in backward
        return PipelineEngine._INSTRUCTION_MAP[pipe_schedule.ReduceGrads](self)
    self._acco_end_round()


class ACCOPipelineEngine(ACCOEngine, PipelineEngine):
    """ACCO on DeepSpeed's ``PipelineEngine`` (Megatron-DeepSpeed's default engine, ``GPTModelPipe``); see
    the module docstring."""

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP,
                        pipe_schedule.BackwardPass: _exec_backward_pass,
                        pipe_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
                        pipe_schedule.ReduceGrads: _exec_reduce_grads}

    @property
    def _acco_rounds_in_backward(self) -> bool:
        return self.num_stages == 1

    def _train_schedule(self):
        if self.num_stages > 1 and self.acco_config.mode == "acco":
            return TwoFlushSchedule(self.micro_batches, self.num_stages, self.stage_id)
        return super()._train_schedule()


__all__ = ["ACCOPipelineEngine", "TwoFlushSchedule"]
