"""Single-process reference simulator of ``acco``, ``dpu`` and ``sync`` training.

This is the test oracle: it writes the update rules of docs/design/algorithm.md as
directly as possible, on one flat parameter vector, with ``W`` simulated
workers that each draw micro-batches from their own stream. It knows nothing
about threads, shards, buffers or DeepSpeed, so agreement between it and the
engine means the engine computes the algorithm, not merely itself.

    acco:  startup: gA = grads at θ0
           step t:  θ̃_{t+1} = Peek(θ_t, gA)           (estimate round)
                    gB = grads at θ_t
                    θ_{t+1}  = Opt(θ_t, gA ∪ gB)        (real round)
                    gA = grads at θ̃_{t+1}
    dpu:   startup: g = grads at θ0;   step t: g' = grads at θ_t, θ_{t+1} = Opt(θ_t, g), g = g'
    sync:  step t:  θ_{t+1} = Opt(θ_t, grads at θ_t)

``g ∪ g'`` means the sum of both gradient sums divided by the total number of
micro-batches. ``Peek`` runs the optimizer on a deep copy of its state and
throws the copy away (the naive way the fused kernel replaces).
"""

import copy
from typing import Callable, List, Optional

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .edit_penalty import Detector, edit_mean


def clip_coefficient(norm: float, max_norm: float) -> float:
    """DeepSpeed ZeRO's clipping rule: divide by max(1, (norm + 1e-6) / max_norm)."""
    if max_norm <= 0:
        return 1.0
    return 1.0 / max(1.0, (norm + 1e-6) / max_norm)


def optimizer_update(opt, params, g_sum: torch.Tensor, n: int, *, commit: bool, clip: float = 0.0, sched=None,
                     norms: Optional[list] = None) -> torch.Tensor:
    """The update every simulator applies: ``opt`` (over ``params``) steps on the mean gradient ``g_sum / n``
    clipped by DeepSpeed's rule (global norm). A commit steps ``sched`` and appends the norm to ``norms``;
    otherwise it is a Peek: the optimizer runs on a deep copy of its state, which is thrown away (the naive
    way the fused kernel replaces), and the parameters are restored. Returns the updated flat parameters."""
    g = g_sum / n
    norm = float(g.norm())
    g = g * clip_coefficient(norm, clip)
    theta = lambda: parameters_to_vector([p.detach() for p in params]).clone()  # noqa: E731
    if not commit:
        saved_theta = theta()
        saved_state = {p: copy.deepcopy(opt.state[p]) for p in params if p in opt.state}
    offset = 0
    for p in params:
        p.grad = g[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    opt.step()
    result = theta()
    for p in params:
        p.grad = None
    if commit:
        if sched is not None:
            sched.step()
        if norms is not None:
            norms.append(norm)
    else:
        with torch.no_grad():
            vector_to_parameters(saved_theta, params)
        opt.state.clear()
        opt.state.update(saved_state)
    return result


def make_replicas(model, R: int, optimizer_fn, lr_lambda, dtype):
    """R copies of ``model`` in ``dtype``, each with its optimizer, LR scheduler (or None) and trainable
    parameters: the replicas of a local-SGD simulator."""
    replicas = [copy.deepcopy(model).to(dtype) for _ in range(R)]
    opts = [optimizer_fn(rep) for rep in replicas]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) if lr_lambda is not None else None for o in opts]
    return replicas, opts, scheds, [[p for p in rep.parameters() if p.requires_grad] for rep in replicas]


def replica_inner_step(model, params, ranks, per_rank: int, nxt: list, loss_fn, micro_batch, opt, clip, sched):
    """One inner step of a local-SGD replica: its ranks' next ``per_rank`` micro-batches each, summed, then one
    update with their mean (the replica's ZeRO-1 group equals one full-batch AdamW step). ``nxt``: each rank's
    next micro-batch index, advanced."""
    for p in params:
        p.grad = None
    n = 0
    for r in ranks:
        for _ in range(per_rank):
            loss_fn(model, micro_batch(r, nxt[r])).backward()
            nxt[r] += 1
            n += 1
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    optimizer_update(opt, params, parameters_to_vector(grads), n, commit=True, clip=clip, sched=sched)

class _Workers:
    """W simulated workers sharing one model; worker w reads micro-batches
    ``micro_batch(w, 0), micro_batch(w, 1), ...`` in order."""

    def __init__(self, model, loss_fn, micro_batch, world_size, counts):
        self.model, self.loss_fn, self.micro_batch = model, loss_fn, micro_batch
        self.world_size, self.counts = world_size, counts
        self.next = [0] * world_size
        self.round = 0

    def grads(self, theta: torch.Tensor):
        """Sum of micro-batch gradients at ``theta`` over all workers for the
        next round, and how many micro-batches went into it."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            vector_to_parameters(theta.to(params[0].dtype), params)
        for p in params:
            p.grad = None
        n = 0
        for w in range(self.world_size):
            for _ in range(self.counts(self.round, w)):
                loss = self.loss_fn(self.model, self.micro_batch(w, self.next[w]))
                loss.backward()
                self.next[w] += 1
                n += 1
        self.round += 1
        g = parameters_to_vector([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        return g.to(theta.dtype), n


def simulate(mode: str,
             model: torch.nn.Module,
             loss_fn: Callable,
             micro_batch: Callable,
             *,
             world_size: int,
             gradient_accumulation_steps: int,
             steps: int,
             optimizer_fn: Callable,
             lr_lambda: Optional[Callable] = None,
             clip: float = 0.0,
             counts: Optional[Callable] = None,
             dtype: torch.dtype = torch.float64) -> dict:
    """Run ``steps`` committed optimizer steps and return
    ``{"params": [θ_1, ..., θ_steps], "grad_norms": [...], "estimates": [θ̃_1, ...]}``
    as flat vectors in ``dtype``.

    Args:
        mode: ``acco`` | ``dpu`` | ``sync``.
        model: copied, converted to ``dtype``; its parameters in
            ``model.parameters()`` order form θ.
        loss_fn: ``loss_fn(model, batch) -> scalar``; not divided by anything.
        micro_batch: ``micro_batch(worker, i)`` gives worker's i-th micro-batch.
        optimizer_fn: ``optimizer_fn(module)`` builds the torch optimizer over a
            copy of ``model`` (so parameter groups work as in the engine).
        lr_lambda: optional ``LambdaLR`` factor, stepped once per committed step.
        clip: DeepSpeed's ``gradient_clipping`` (0: off).
        counts: ``counts(round, worker)`` micro-batches per round (adaptive
            accumulation); default: the fixed count of the mode.
    """
    worker_model = copy.deepcopy(model).to(dtype)
    master = copy.deepcopy(model).to(dtype)
    masters = [p for p in master.parameters() if p.requires_grad]
    opt = optimizer_fn(master)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    per_round = gradient_accumulation_steps // 2 if mode == "acco" else gradient_accumulation_steps
    workers = _Workers(worker_model, loss_fn, micro_batch, world_size, counts or (lambda r, w: per_round))
    out = {"params": [], "grad_norms": [], "estimates": []}

    def theta():
        return parameters_to_vector([p.detach() for p in masters]).clone()

    def update(g_sum, n, commit):
        return optimizer_update(opt, masters, g_sum, n, commit=commit, clip=clip, sched=sched,
                                norms=out["grad_norms"])

    if mode == "sync":
        for _ in range(steps):
            g, n = workers.grads(theta())
            out["params"].append(update(g, n, commit=True))
    elif mode == "dpu":
        g, n = workers.grads(theta())
        for _ in range(steps):
            g_next, n_next = workers.grads(theta())
            out["params"].append(update(g, n, commit=True))
            g, n = g_next, n_next
    elif mode == "acco":
        g_a, n_a = workers.grads(theta())
        for _ in range(steps):
            estimate = update(g_a, n_a, commit=False)
            out["estimates"].append(estimate)
            g_b, n_b = workers.grads(theta())
            out["params"].append(update(g_a + g_b, n_a + n_b, commit=True))
            g_a, n_a = workers.grads(estimate)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return out


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    """θ of a module in the order ``simulate`` uses."""
    return parameters_to_vector([p.detach() for p in module.parameters() if p.requires_grad])


__all__: List[str] = ["simulate", "simulate_local_sgd", "optimizer_update", "clip_coefficient", "flat_params"]


def simulate_local_sgd(mode: str,
                       model: torch.nn.Module,
                       loss_fn: Callable,
                       micro_batch: Callable,
                       *,
                       world_size: int,
                       group_size: int,
                       gradient_accumulation_steps: int,
                       steps: int,
                       sync_every: int,
                       optimizer_fn: Callable,
                       outer_lr: float,
                       outer_momentum: float,
                       nesterov: bool,
                       staleness_penalty: float = 1.0,
                       momentum_clip: Optional[float] = None,
                       lr_lambda: Optional[Callable] = None,
                       clip: float = 0.0,
                       weighting: str = "mean",
                       pseudo_grad_clip: Optional[float] = None,
                       anomaly: Optional[dict] = None,
                       period_steps: Optional[List[List[int]]] = None,
                       fragments: int = 1,
                       fragment_sync_delay: int = 0,
                       fragment_update_alpha: float = 0.0,
                       fragment_owner: Optional[List[int]] = None,
                       dtype: torch.dtype = torch.float64) -> dict:
    """``diloco`` / ``co2`` / ``edit`` (docs/design/outer-loops.md) with ``R = world_size / group_size`` replicas.

    Replica ``g`` is the ranks ``g*k .. g*k+k-1``; each of its inner steps is
    one full-batch step of its own optimizer on the ``k * gas`` micro-batches
    those ranks draw (rank r's i-th is ``micro_batch(r, i)``), clipped by the
    replica's global norm. Every ``sync_every`` inner steps::

        diloco:  δ_i = x − θ_i;  x = Outer(x, mean δ);  θ_i = x
        co2:     δ_i = s_i − θ_i;  if a mean is in flight: x = Outer(x, it);  θ_i = s_i = x − δ_i;
                 the mean of this δ is in flight until the next sync

        edit:    δ_i = x − θ_i;  x = Outer(x, Σ w_i δ_i · clip);  θ_i = x   (``edit_penalty.edit_mean``)

    Streaming DiLoCo (``diloco`` with ``fragments`` F, ``fragment_sync_delay`` τ, ``fragment_update_alpha``
    α; docs/design/outer-loops.md, Streaming DiLoCo): parameter j (element offset o_j, N elements) is in fragment ⌊F o_j / N⌋
    (``fragment_owner`` overrides that, e.g. pipeline stages each cutting their own parameters);
    window w of h = sync_every / F steps belongs to fragment f = w mod F; at its step h − τ the mean
    δ̄_f of x_f − θ_{i,f} is taken, at its step h x_f = Outer(x_f, δ̄_f) with fragment f's own momentum and
    θ_{i,f} = lerp(x_f, θ_{i,f}, α).

    ``period_steps`` (A-EDiT, ``edit`` only): period p runs ``period_steps[p][g]`` inner steps on
    replica g, then syncs with ``w_g`` proportional to those steps; ``steps``/``sync_every`` are unused.

    Returns ``{"replicas": [[θ_g after inner step t] per step] per replica, "anchor": [x after step t]}``
    (A-EDiT: ``anchor`` holds x after each sync, and ``flags`` the anomalous replicas of every sync).
    """
    k, R = group_size, world_size // group_size
    per_step = gradient_accumulation_steps
    replicas, opts, scheds, params = make_replicas(model, R, optimizer_fn, lr_lambda, dtype)
    theta = lambda g: parameters_to_vector([p.detach() for p in params[g]]).clone()  # noqa: E731
    x = theta(0)
    m = torch.zeros_like(x)
    starts = [x.clone() for _ in range(R)]
    in_flight = None
    nxt = [0] * world_size
    out = {"replicas": [[] for _ in range(R)], "anchor": []}

    def outer(mean_delta):
        g = mean_delta / staleness_penalty
        m.mul_(outer_momentum).add_(g)
        if momentum_clip is not None:
            m.clamp_(-momentum_clip, momentum_clip)
        x.sub_(g + outer_momentum * m if nesterov else m, alpha=outer_lr)

    def inner_step(g):
        replica_inner_step(replicas[g], params[g], range(g * k, (g + 1) * k), per_step, nxt, loss_fn, micro_batch,
                           opts[g], clip, scheds[g])

    def set_replica(g, value):
        with torch.no_grad():  # a copy: vector_to_parameters makes the parameters views of its input
            vector_to_parameters(value.to(dtype).clone(), params[g])

    out["flags"] = []
    detector = Detector(R, **anomaly) if anomaly else None

    def edit_sync(steps_done):
        deltas = [x - theta(g) for g in range(R)]
        norms = torch.stack([d.norm() for d in deltas])
        flags = detector.observe(norms.tolist()) if detector else [False] * R
        out["flags"].append(flags)
        outer(edit_mean(deltas, norms, flags, weighting, steps_done, pseudo_grad_clip))
        for g in range(R):
            set_replica(g, x)

    if period_steps is not None:  # A-EDiT: periods of unequal step counts
        for counts in period_steps:
            for g in range(R):
                for _ in range(counts[g]):
                    inner_step(g)
                    out["replicas"][g].append(theta(g))
            edit_sync(counts)
            for g in range(R):  # a period's last inner step is recorded after its sync, as in step mode
                out["replicas"][g][-1] = theta(g)
            out["anchor"].append(x.clone())
        return out

    streaming = mode == "diloco" and (fragments, fragment_sync_delay, fragment_update_alpha) != (1, 0, 0.0)
    if streaming:
        sizes = [p.numel() for p in params[0]]
        owner = fragment_owner or [fragments * sum(sizes[:j]) // sum(sizes) for j in range(len(sizes))]
        members = [torch.cat([torch.full((n,), owner[j] == f) for j, n in enumerate(sizes)]) for f in range(fragments)]
        h, pending = sync_every // fragments, None

    for step in range(1, steps + 1):
        for g in range(R):
            inner_step(g)
        if streaming:
            f, s = ((step - 1) // h) % fragments, step - ((step - 1) // h) * h
            idx = members[f]
            if s == h - fragment_sync_delay:
                pending = torch.stack([x[idx] - theta(g)[idx] for g in range(R)]).mean(0)
            if s == h:
                d, mf = pending, m[idx]
                mf.mul_(outer_momentum).add_(d)
                x[idx] = x[idx] - outer_lr * (d + outer_momentum * mf if nesterov else mf)
                m[idx] = mf
                for g in range(R):
                    local = theta(g)
                    local[idx] = torch.lerp(x[idx], local[idx], fragment_update_alpha)
                    set_replica(g, local)
        elif step % sync_every == 0:
            if mode == "edit":
                edit_sync(None)
            elif mode == "diloco":
                outer(torch.stack([x - theta(g) for g in range(R)]).mean(0))
                for g in range(R):
                    set_replica(g, x)
            elif mode == "co2":
                deltas = [starts[g] - theta(g) for g in range(R)]
                if in_flight is not None:
                    outer(in_flight)
                for g in range(R):
                    starts[g] = x - deltas[g]
                    set_replica(g, starts[g])
                in_flight = torch.stack(deltas).mean(0)
            else:
                raise ValueError(f"unknown local-SGD mode {mode!r}")
        for g in range(R):
            out["replicas"][g].append(theta(g))
        out["anchor"].append(x.clone())
    return out
