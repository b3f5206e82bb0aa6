"""One rank of the fault drill (benchmarks/faults.py): a tiny MLP trained with
``acco_ds.initialize`` on deterministic data, checkpointing every K steps.

    python benchmarks/fault_worker.py spec.json outdir      # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

The spec (JSON) says what to do; see ``DEFAULTS``. The worker prints
machine-readable progress lines, ``FAULTDRILL <event> key=value ...``, which
the driver polls to inject a fault at a known point, and saves its final
state to ``outdir/result<rank>.pt`` (flat fp32 parameters, counters).

``ACCO_FAULT_NO_SHM=1`` (the default) skips DeepSpeed's shared-memory
inference all-reduce op, which training does not use.

With ``ACCO_FAULT_NO_AOT=1`` the op builder ignores an ahead-of-time built
module, so ``"kernels": "native"`` JIT-builds the C++ op (the JIT scenario).
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

DEFAULTS = {
    "acco": True,  # False: stock DeepSpeed ZeRO-1 (no "acco" block)
    "mode": "acco",
    "kernels": "torch",
    "timeout_s": None,  # "acco": {"timeout_s": ...}
    "pg_timeout": 60,  # init_distributed(timeout=...)
    "gas": 2,
    "dtype": "fp32",
    "steps": 8,  # train until engine.global_steps reaches this
    "max_micro": 10_000,
    "save_dir": None,
    "save_every": 0,  # save a checkpoint every K committed steps (0: never)
    "load": False,  # load_checkpoint(save_dir) first
    "load_dir": None,  # defaults to save_dir
    "load_kwargs": {},
    "micro_sleep": 0.0,  # seconds of extra "compute" per micro-batch, so a fault lands mid-training
    "bad_grads": [],  # [[micro index, "nan" | "inf"], ...]: that micro-batch's loss on rank 0 is made non-finite
    "stop_after_start": False,  # exit right after initialize (+ load): the JIT scenario's "successful start"
    "seed": 1,
}

IN, HIDDEN, OUT, MICRO_BATCH = 16, 64, 4, 8


_T0 = time.time()


def say(event, **kv):
    print("FAULTDRILL " + event + "".join(f" {k}={v}" for k, v in kv.items()) + f" t={time.time() - _T0:.2f}",
          flush=True)


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def micro_batch(rank, i):
    g = torch.Generator().manual_seed(1_000_003 * rank + i + 7)
    return torch.randn(MICRO_BATCH, IN, generator=g), torch.randn(MICRO_BATCH, OUT, generator=g)


def ds_config(spec):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": spec["gas"],
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 100_000,
        "wall_clock_breakdown": False,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    if spec["acco"]:
        cfg["acco"] = {"enabled": True, "mode": spec["mode"], "kernels": spec["kernels"]}
        if spec["timeout_s"] is not None:
            cfg["acco"]["timeout_s"] = spec["timeout_s"]
    return cfg


def flat(module):
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).clone()


def main():
    spec = dict(DEFAULTS, **json.load(open(sys.argv[1])))
    outdir = sys.argv[2]
    rank = int(os.environ["RANK"])
    t0 = time.time()
    if os.environ.get("ACCO_FAULT_TRACE_S"):  # debugging the drill: where is a rank stuck?
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["ACCO_FAULT_TRACE_S"]), repeat=True)
    if os.environ.get("ACCO_FAULT_NO_AOT") == "1":
        from acco_ds.ops import builder
        builder._AccoOpBuilder.aot_module = lambda self: None
    if spec["dtype"] == "fp16":
        # DeepSpeed's CPU accelerator refuses fp16; torch computes it, and loss scaling is device independent.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    import deepspeed
    if os.environ.get("ACCO_FAULT_NO_SHM", "1") == "1":
        from harness import skip_deepspeed_shm_op
        skip_deepspeed_shm_op()  # nor builds it in a private TORCH_EXTENSIONS_DIR (the JIT scenario's)

    import acco_ds
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=spec["pg_timeout"]))
    model = make_model(spec["seed"])
    if spec["dtype"] == "bf16":
        model = model.to(torch.bfloat16)
    elif spec["dtype"] == "fp16":
        model = model.to(torch.float16)
    say("INIT", rank=rank)
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=model.parameters(), config=ds_config(spec))
    micro = 0
    if spec["load"]:
        path, client = engine.load_checkpoint(spec["load_dir"] or spec["save_dir"], **spec["load_kwargs"])
        if path is None:
            raise RuntimeError(f"load_checkpoint found no checkpoint in {spec['load_dir'] or spec['save_dir']}")
        micro = int(client["micro"]) if client and "micro" in client else 0
        say("LOADED", rank=rank, step=engine.global_steps, micro=micro, path=os.path.basename(str(path)))
    say("STARTED", rank=rank, seconds=f"{time.time() - t0:.2f}")
    if spec["stop_after_start"]:
        engine.destroy()
        return
    bad = {int(m): kind for m, kind in spec["bad_grads"]}
    dtype = next(engine.module.parameters()).dtype
    last_step = engine.global_steps
    while engine.global_steps < spec["steps"] and micro < spec["max_micro"]:
        x, y = micro_batch(rank, micro)
        loss = ((engine(x.to(dtype)).float() - y)**2).mean()
        if rank == 0 and micro in bad:
            loss = loss * float("nan" if bad[micro] == "nan" else "inf")
        if spec["micro_sleep"]:
            time.sleep(spec["micro_sleep"])
        engine.backward(loss)
        engine.step()
        micro += 1
        if engine.global_steps != last_step:
            last_step = engine.global_steps
            say("STEP", rank=rank, step=last_step, micro=micro)
            if spec["save_every"] and last_step % spec["save_every"] == 0:
                engine.save_checkpoint(spec["save_dir"], client_state={"micro": micro})
                say("SAVED", rank=rank, step=last_step, micro=micro)
    params = flat(engine.module)
    result = {"params": params, "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
              "micro": micro, "finite": bool(torch.isfinite(params).all())}
    engine.destroy()
    torch.save(result, os.path.join(outdir, f"result{rank}.pt"))
    say("DONE", rank=rank, step=result["global_steps"], skipped=result["skipped_steps"], finite=result["finite"])


if __name__ == "__main__":
    main()
