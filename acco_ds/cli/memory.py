"""``acco-ds memory``: the model-state estimator (``acco_ds.memory.estimate_memory``) from a shell."""

import argparse

from ..runtime.dtypes import DTYPES
from ..memory import estimate_memory


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="acco-ds memory", description="Model-state memory per rank: stock ZeRO-1 vs "
                                "ACCO (Adam). Activations come on top.")
    p.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7e9")
    p.add_argument("--gpus", type=int, default=8, help="data-parallel ranks")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--grad-accum-dtype", choices=list(DTYPES), default=None)
    p.add_argument("--communication-data-type", choices=list(DTYPES), default=None)
    p.add_argument("--mode", choices=["acco", "dpu", "sync", "diloco", "co2", "edit", "sparseloco"],
                   default="acco")
    p.add_argument("--replica-group-size", type=int, default=None, help="k, for --mode diloco/co2/edit (default 1)")
    p.add_argument("--fragments", type=int, default=1, help="--mode diloco: Streaming DiLoCo fragments (F)")
    p.add_argument("--overlap", type=int, default=0, help="--mode sparseloco: local_sgd.overlap (the weights at "
                   "the sync are kept while the gather is in flight: 4N/k more)")
    p.add_argument("--compression", choices=["int8", "fp8"], default=None,
                   help="acco.compression.dtype (error-feedback residuals are counted)")
    p.add_argument("--residual-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--nodes", type=int, default=None, help="nodes of a node-aware layout (default: flat)")
    p.add_argument("--budget-gb", type=float, default=80.0)
    p.add_argument("--expert-params", type=float, default=0,
                   help="mixture of experts: how many of --params are experts' (all experts of every MoE layer)")
    p.add_argument("--ep-size", type=int, default=1, help="expert parallelism: ranks that split the experts")
    args = p.parse_args(argv)
    estimate_memory(params=int(args.params), gpus=args.gpus, dtype=args.dtype, grad_accum_dtype=args.grad_accum_dtype,
                    communication_data_type=args.communication_data_type, mode=args.mode,
                    replica_group_size=args.replica_group_size, budget_gb=args.budget_gb, nodes=args.nodes,
                    fragments=args.fragments, overlap=args.overlap, expert_params=int(args.expert_params), ep_size=args.ep_size,
                    compression={"dtype": args.compression, "residual_dtype": args.residual_dtype}
                    if args.compression else None)
    return 0


__all__ = ["main"]
