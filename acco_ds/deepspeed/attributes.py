"""The attributes DeepSpeed's constructors set that acco_ds reads (or writes), each with the reason:
``compat.check_instance`` checks them on the built objects. Kept apart from ``compat`` (which re-exports the
list) so each module stays readable; nothing here imports DeepSpeed."""

from typing import Dict, Tuple

# Attributes DeepSpeed's constructors set, read (or written) by acco_ds: checked on the instance.
INSTANCE_ATTRIBUTES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "DeepSpeedZeroOptimizer": (
        ("optimizer", "the wrapped torch optimizer over the fp32 master shards"),
        ("single_partition_of_fp32_groups", "the fp32 master shards the update writes"),
        ("bit16_groups_flat", "the flat 16-bit parameters rounds gather into"),
        ("round_robin_bit16_groups", "the parameters in flat order (views, hooks)"),
        ("round_robin_bit16_offsets", "each parameter's offset in its flat group"),
        ("round_robin_bit16_meta", "each parameter's shape in its flat group"),
        ("partition_size", "each group's shard size"),
        ("dp_process_group", "the group ZeRO-1 shards over"),
        ("model_parallel_group", "the tensor-parallel group (global norm)"),
        ("model_parallel_world_size", "whether tensor parallelism is on"),
        ("model_parallel_rank", "which tensor-parallel slices this rank holds"),
        ("mpu", "the model-parallel unit: its tensor-parallel size (sparseloco refuses tensor parallelism)"),
        ("device", "where buffers live"),
        ("dtype", "the model's 16-bit dtype"),
        ("gradient_accumulation_dtype", "the accumulator dtype (data_types.grad_accum_dtype)"),
        ("gradient_accumulation_steps", "micro-batches per round"),
        ("clip_grad", "gradient_clipping"),
        ("loss_scaler", "fp16 dynamic loss scaling"),
        ("dynamic_loss_scale", "whether the loss scale moves"),
        ("overflow", "written: stock's overflow flag, read by the engine"),
        ("_grad_acc_hooks", "written: stock's gradient hooks, none (ACCO's own hooks feed its accumulator)"),
        ("groups_padding", "each group's padding on this rank (a resharded checkpoint's own)"),
        ("round_robin_bit16_padding", "the parameter-alignment padding (a flat group's length)"),
        ("partition_count", "ranks per group (a resharded checkpoint's own)"),
        ("round_robin_gradients", "flat groups ordered by world size cannot be resharded"),
        ("has_moe_layers", "MoE: expert param groups are partitioned over their own groups"),
        ("real_dp_process_group", "MoE: the group each param group is partitioned over (expert-data-parallel)"),
        ("ep_process_group", "MoE: the expert-parallel groups by name (ep_size, saved and checked at load)"),
        ("param_groups", "MoE: which param groups hold experts (moe, name)"),
    ),
    "DeepSpeedEngine (a checkpoint loaded)": (
        ("loaded_checkpoint_dp_world_size", "the data-parallel size the checkpoint was saved with"),
    ),
    "DeepSpeedEngine": (
        ("_config", "the parsed DeepSpeed config"),
        ("module", "the user's model"),
        ("optimizer", "the ZeRO-1 optimizer"),
        ("lr_scheduler", "stepped once per committed step"),
        ("global_steps", "counted per committed step"),
        ("global_samples", "counted per committed step"),
        ("skipped_steps", "counted per skipped (overflow) step"),
        ("_step_applied", "written: was_step_applied()"),
        ("_global_grad_norm", "written: get_global_grad_norm()"),
        ("save_zero_checkpoint", "written: every replica saves its optimizer shards"),
        ("seq_data_parallel_group", "the data-parallel group the replicas are cut from"),
        ("dp_world_size", "the data-parallel world size"),
        ("communication_data_type", "the reduce dtype (communication_data_type)"),
        ("checkpoint_mp_rank", "the model-parallel rank in checkpoint names"),
        ("engine_timers", "DeepSpeed's backward timers"),
        ("global_rank", "rank-0 logging"),
        ("monitor", "monitor events per committed step"),
        ("steps_per_print", "the progress line's period"),
        ("has_moe_layers", "MoE: expert groups inside a local-SGD replica"),
        ("expert_parallel_group", "MoE: the expert-parallel groups (must lie inside a replica)"),
        ("mp_world_size", "MoE: refused beside model parallelism"),
    ),
    "DeepSpeedConfig": (
        ("zero_optimization_stage", "ZeRO stage 1 is required"),
        ("zero_config", "zero_optimization's keys (overlap_comm, zenflow)"),
        ("gradient_accumulation_steps", "micro-batches per round"),
        ("world_size", "the data-parallel world size replicas are cut from"),
        ("managed_gradient_accumulation", "ACCO drives accumulation itself"),
        ("optimizer_name", "an optimizer is required"),
        ("optimizer_params", "Muon: per_head_muon is refused"),
    ),
    "DeepSpeedZeroConfig": (
        ("overlap_comm", "to say it is not used (rounds overlap instead)"),
        ("zenflow", "to refuse ZenFlow, which replaces the same update"),
    ),
    "PipelineModule": (
        ("num_stages", "the pipeline's stage count"),
    ),
    "PipelineEngine": (
        ("num_stages", "more than one stage: rounds end at the schedule's reductions"),
        ("stage_id", "this rank's stage (the schedule)"),
        ("micro_batches", "micro-batches per train_batch (the schedule)"),
    ),
}


__all__ = ["INSTANCE_ATTRIBUTES"]
