"""The local-SGD and MoE sections of ``gpu_check.py``, on 2 ranks:
- diloco, Streaming DiLoCo, sparseloco, co2, edit and decoupled (2 replicas of 1), then A-EDiT's save without a
  tag (the ranks agree on the tag with an all-reduce: on NCCL a host tensor there raises) and a resume in fresh
  engines whose committed weights must equal the saved ones bit for bit;
- with ``--moe``: a GPT whose MLPs are ``deepspeed.moe.layer.MoE`` (4 experts, top-2, ``ep_size`` 2) under stock
  ZeRO-1, sync (stock's update: the losses must agree) and acco, on one replica of 2 ranks.

    python benchmarks/gpu_local_sgd.py --device cuda [--tiny] [--moe] --out DIR   # starts its own 2 ranks

NCCL needs one GPU per rank. With one GPU both ranks share it and talk over gloo with CUDA tensors: the CUDA
paths of every mode run (device buffers, kernels, copies), not a speed figure. Without CUDA the ranks run on the
CPU with gloo. ``launch`` returns rank 0's JSON.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# name -> (acco.mode, acco.local_sgd keys beside sync_every and replica_group_size)
MODES = {"diloco": ("diloco", {}), "streaming": ("diloco", {"fragments": 2}),
         "sparseloco": ("sparseloco", {}), "co2": ("co2", {}), "edit": ("edit", {}),
         "decoupled": ("decoupled", {"min_quorum": 2, "grace_s": 0})}
MOE = dict(num_experts=4, ep_size=2, k=2)


def launch(device: str, tiny: bool, out_dir, timeout_s: float = 300.0, world: int = 2, moe: bool = False) -> dict:
    """Start ``world`` ranks of this file on ``device`` and return rank 0's results (raises with the logs'
    tails when a rank fails or the time runs out)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"DS_ACCELERATOR": device, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(harness.free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--worker", "--device", device, "--out", str(out_dir)] + \
        (["--tiny"] if tiny else []) + (["--moe"] if moe else [])
    gpus = _cuda_devices() if device == "cuda" else world
    # Fewer GPUs than ranks: the ranks share them; DeepSpeed binds rank r to cuda:LOCAL_RANK, so LOCAL_RANK names
    # the device a rank shares.
    commands = [({**env, "RANK": str(r), "LOCAL_RANK": str(r % max(gpus, 1))}, cmd) for r in range(world)]
    with harness.RankSet(commands, out_dir, "local-SGD ranks") as ranks:
        ranks.finish(timeout_s)  # raises with every rank's log tail when one fails or the time runs out
    return {**json.loads((out_dir / "rank0.json").read_text()), "command": " ".join(cmd), "world_size": world}


def _cuda_devices() -> int:
    import torch
    return torch.cuda.device_count()


def worker(args):
    import torch
    import torch.distributed as tdist

    import acco_ds
    import deepspeed
    from gpu_model import GPT, TINY_SHAPE, batch, load_corpus

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = args.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")  # LOCAL_RANK names a shared GPU too
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if gpus >= int(os.environ["WORLD_SIZE"]) else "gloo"
    if backend == "gloo" and cuda:
        # DeepSpeed would bind the default group to cuda:LOCAL_RANK; torch then builds every new group by
        # splitting the default one, which a gloo group cannot (no perform_nocolor_split): start it unbound.
        tdist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend=backend)
    shape = TINY_SHAPE if args.tiny else dict(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=256)
    micro, gas, steps, period = (2, 2, 6, 2) if args.tiny else (8, 2, 40, 8)
    sync_time_s = 0.5 if args.tiny else 2.0
    data = load_corpus(1_000_000)

    def config(mode, rounds=False, **local):
        """``mode`` None: stock ZeRO-1; ``rounds``: a round mode (no local_sgd block)."""
        if mode is None:
            return {k: v for k, v in config("sync", rounds=True).items() if k != "acco"}
        acco = {"enabled": True, "mode": mode}
        if not rounds:
            acco["local_sgd"] = {"replica_group_size": 1, **local}
        return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                          "torch_adam": True}},
                "acco": acco}

    counter = {"micro": 0}

    def engine_for(cfg, moe=None):
        counter["micro"] = 0  # every run reads the same windows
        torch.manual_seed(1234)
        model = GPT(**shape, moe=moe)
        params = list(model.parameters())
        if moe is not None:  # expert parameters in their own groups, as DeepSpeed's ZeRO wants them
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
            params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})
        initialize = acco_ds.initialize if "acco" in cfg else deepspeed.initialize
        return initialize(model=model, model_parameters=params, config=cfg)[0]


    def train_step(engine):
        """One inner step (gas micro-batches); each replica reads its own windows."""
        losses = []
        for _ in range(gas):
            loss = engine(*batch(data, 100_000 * rank + counter["micro"], micro, shape["block_size"], device))
            engine.backward(loss)
            engine.step()
            counter["micro"] += 1
            losses.append(float(loss))
        return sum(losses) / gas

    def committed(engine):
        """What users read (the anchor), as one flat fp32 CPU tensor."""
        return torch.cat([t.detach().float().flatten().cpu() for t in engine.module.state_dict().values()])

    def same_on_every_rank(flat):
        mine = flat.to(device)
        every = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
        tdist.all_gather(every, mine)
        return all(torch.equal(every[0], x) for x in every)

    result = {"device": str(device), "backend": tdist.get_backend(), "runs": {}}
    if args.moe:
        return moe_worker(args, rank, result, config, engine_for, train_step, committed, same_on_every_rank,
                          steps, gas, micro, shape)
    for name, (mode, local) in MODES.items():
        if mode == "decoupled":
            local = {**local, "syncer": {"state_dir": str(Path(args.out) / "syncer"), "timeout_s": 120}}
        engine = engine_for(config(mode, sync_every=period, **local))
        t0 = time.perf_counter()
        losses = [train_step(engine) for _ in range(steps)]
        seconds = time.perf_counter() - t0
        syncs = engine.acco_syncs
        engine.acco_finalize()
        result["runs"][name] = {"losses": losses, "syncs": syncs, "seconds": seconds,
                                "tokens_per_s": steps * gas * micro * shape["block_size"] * 2 / seconds,
                                "one_model_after_finalize": same_on_every_rank(committed(engine)),
                                "report": [list(line) for line in engine.acco_report()]}
        engine.destroy()

    # A-EDiT: periods end on wall time; the loop ends on syncs (the same on every rank).
    ckpt = Path(args.out) / "a_edit_ckpt"
    engine = engine_for(config("edit", sync_time_s=sync_time_s))
    while engine.acco_syncs < 2:
        train_step(engine)
    engine.save_checkpoint(str(ckpt))  # no tag: the ranks agree on global_step<most steps of any replica>
    saved, saved_steps = committed(engine), engine.global_steps
    tag = (ckpt / "latest").read_text().strip()
    engine.destroy()
    engine = engine_for(config("edit", sync_time_s=sync_time_s))
    engine.load_checkpoint(str(ckpt))
    loaded = committed(engine)
    syncs_at_load = engine.acco_syncs
    after = [train_step(engine) for _ in range(2)]
    while engine.acco_syncs < syncs_at_load + 1:
        after.append(train_step(engine))
    engine.acco_finalize()
    result["a_edit_resume"] = {"tag": tag, "saved_steps": saved_steps, "syncs_at_load": syncs_at_load,
                               "loaded_equals_saved": bool(torch.equal(saved, loaded)),
                               "losses_after_load": after, "syncs_after": engine.acco_syncs,
                               "one_model_after_finalize": same_on_every_rank(committed(engine))}
    engine.destroy()
    if rank == 0:
        (Path(args.out) / "rank0.json").write_text(json.dumps(result, indent=1))


def moe_worker(args, rank, result, config, engine_for, train_step, committed, same_on_every_rank, steps, gas,
               micro, shape):
    """Stock ZeRO-1, sync and acco on the MoE GPT (one replica of 2 ranks, each reading its own windows).
    Clipping off: ACCO computes the clip norm in fp64, stock from bf16 gradients (see ``gpu_check.ds_config``)."""
    import torch
    result["moe"] = MOE
    for name, mode in (("stock", None), ("sync", "sync"), ("acco", "acco")):
        cfg = {**config(mode, rounds=True), "gradient_clipping": 0.0}
        engine = engine_for(cfg, moe=MOE)
        torch.manual_seed(4321)  # top-2 gating draws Gumbel noise: the same draws in every run
        t0 = time.perf_counter()
        losses = [train_step(engine) for _ in range(steps)]
        seconds = time.perf_counter() - t0
        if hasattr(engine, "acco_committed_weights"):
            with engine.acco_committed_weights():
                flat = committed(engine)
        else:
            flat = committed(engine)
        result["runs"][name] = {"losses": losses, "seconds": seconds,
                                "tokens_per_s": steps * gas * micro * shape["block_size"] * 2 / seconds,
                                "experts_on_rank": sum(p.numel() for n, p in engine.module.named_parameters()
                                                       if "deepspeed_experts" in n),
                                "finite": bool(torch.isfinite(flat).all()),
                                "dense_same_on_every_rank": same_on_every_rank(torch.cat([
                                    p.detach().float().flatten().cpu() for n, p in engine.module.named_parameters()
                                    if "deepspeed_experts" not in n]))}
        engine.destroy()
    stock, sync = result["runs"]["stock"]["losses"], result["runs"]["sync"]["losses"]
    result["sync_vs_stock_max_loss_diff"] = max(abs(a - b) for a, b in zip(stock, sync))
    if rank == 0:
        (Path(args.out) / "rank0.json").write_text(json.dumps(result, indent=1))


# The sections of gpu_check.py (each returns the section's JSON; ``log`` prints a line)


def local_sgd_section(device, tiny, out_path, log):
    """diloco, streaming, sparseloco, co2, edit, decoupled, A-EDiT on 2 ranks, and A-EDiT's save (tag agreed by
    all-reduce) and resume (``gpu_local_sgd.py``). NCCL needs a GPU per rank: with one GPU both ranks share it
    over gloo with CUDA tensors."""
    cuda = device == "cuda"
    gpus = _cuda_devices() if cuda else 0
    out = launch(device, tiny, Path(out_path).with_suffix(".local_sgd"), timeout_s=180)
    resume = out["a_edit_resume"]
    for mode, r in out["runs"].items():
        log(f"{mode:<10} {r['tokens_per_s']:>10,.0f} tokens/s | loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} "
            f"| {r['syncs']} syncs | one model after finalize: {r['one_model_after_finalize']}")
    log(f"A-EDiT save (tag {resume['tag']}) and resume: committed weights equal {resume['loaded_equals_saved']}")
    why = None if gpus >= 2 or not cuda else (f"{gpus} GPU: NCCL needs one per rank, so the 2 ranks shared it over "
                                              f"gloo with CUDA tensors ({out['device']})")
    learned = all(r["losses"][-1] < r["losses"][0] for r in out["runs"].values())  # 6 tiny steps may not
    ok = resume["loaded_equals_saved"] and all(r["one_model_after_finalize"] for r in out["runs"].values()) and \
        (learned or tiny)
    return {"status": f"ran {', '.join(out['runs'])} and A-EDiT save/resume on {out['backend']} ({out['device']})",
            "note": why, "runs": out["runs"], "a_edit_resume": resume, "command": out["command"], "ok": ok}


def moe_section(device, tiny, out_path, log):
    """The MoE GPT (``deepspeed.moe.layer.MoE``, ep_size 2) under stock ZeRO-1, sync and acco on 2 ranks."""
    out = launch(device, tiny, Path(out_path).with_suffix(".moe"), timeout_s=120, moe=True)
    for mode, r in out["runs"].items():
        log(f"MoE {mode:<6} {r['tokens_per_s']:>10,.0f} tokens/s | loss {r['losses'][0]:.4f} -> "
            f"{r['losses'][-1]:.4f} | dense weights equal on both ranks: {r['dense_same_on_every_rank']}")
    log(f"MoE sync vs stock max loss difference {out['sync_vs_stock_max_loss_diff']:.3g}")
    ok = all(r["finite"] and r["dense_same_on_every_rank"] and (r["losses"][-1] < r["losses"][0] or tiny)
             for r in out["runs"].values())
    return {"status": f"stock, sync, acco with {out['moe']} on {out['backend']} ({out['device']})", **out,
            "autoep": "not run here: AutoEP trains on CPU ranks (tests/test_autoep.py), it does not need cuda",
            "ok": ok}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--moe", action="store_true", help="the MoE GPT under stock, sync and acco instead")
    p.add_argument("--out", required=True)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
    else:
        import torch
        print(json.dumps(launch(a.device, a.tiny, a.out, moe=a.moe), indent=1))
