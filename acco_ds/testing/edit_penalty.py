"""EDiT's pseudo-gradient penalty as the simulator writes it (``simulator.simulate_local_sgd`` mode ``edit``):
the penalised average and the anomaly detector, written apart from ``algorithms.penalty`` so that the engine
is checked against an independent statement of the rules (docs/design/outer-loops.md)."""

import torch


def edit_mean(deltas, norms, flags, weighting, steps, clip):
    """EDiT's penalised average: kept replicas weighted by softmax(−‖δ‖) ("norm") or equally ("mean"),
    times their inner steps (A-EDiT), normalised; then the clip of the average's norm."""
    keep = torch.tensor([0.0 if f else 1.0 for f in flags], dtype=norms.dtype)
    w = keep * (torch.exp(-norms) if weighting == "norm" else torch.ones_like(norms))
    if steps is not None:
        w = w * torch.tensor(steps, dtype=norms.dtype)
    w = w / w.sum() if w.sum() > 0 else w
    mean = sum(wi * d for wi, d in zip(w, deltas))
    if clip is not None:
        mean = mean * min(1.0, clip / (float(mean.norm()) + 1e-6))
    return mean


class Detector:
    """Per-replica z-score test: plain mean/variance over the first ``warmup_syncs`` kept norms, then
    exponentially weighted; anomalous norms are not added (written apart from ``algorithms.penalty``)."""

    def __init__(self, replicas, ewma_alpha, warmup_syncs, threshold):
        self.alpha, self.warmup, self.threshold = ewma_alpha, max(warmup_syncs, 2), threshold
        self.seen = [[] for _ in range(replicas)]
        self.mean, self.var = [0.0] * replicas, [0.0] * replicas

    def observe(self, norms):
        flags = []
        for i, n in enumerate(norms):
            hist = self.seen[i]
            bad = len(hist) >= self.warmup and (n - self.mean[i]) > self.threshold * self.var[i] ** 0.5
            flags.append(bad)
            if bad:
                continue
            hist.append(n)
            if len(hist) <= self.warmup:
                t = torch.tensor(hist, dtype=torch.float64)
                self.mean[i], self.var[i] = float(t.mean()), float(t.var(unbiased=False))
            else:
                d = n - self.mean[i]
                self.mean[i] += self.alpha * d
                self.var[i] = (1 - self.alpha) * (self.var[i] + self.alpha * d * d)
        return flags
