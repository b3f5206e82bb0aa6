"""Token factors: tokens to a target loss relative to stock ZeRO-1, each with the source it comes from.

From 100M parameters up the defaults come from the papers of each mode (``literature``); below, from the races
measured on the two-node testbed (``measured``); ``--token-factors`` picks either, ``--token-factor MODE=F``
overrides one mode. Every source names a paper by title and arXiv id. docs/plan.md has the table and the
reasoning behind each number.
"""

import math

LITERATURE_FROM = 100e6  # parameters: from here up the papers' defaults apply
REFERENCE_H = 8  # the period at which the local-SGD factors were measured (and given factors are read)

ZERO = "ZeRO (Rajbhandari et al., 'ZeRO: Memory Optimizations Toward Training Trillion Parameter Models', " \
       "arXiv 1910.02054)"
ACCO = "ACCO (Nabli et al., 'ACCO: Accumulate While You Communicate for Communication-Overlapped Sharded LLM " \
       "Training', arXiv 2406.02613)"
OFFLOAD = "ZeRO-Offload (Ren et al., 'ZeRO-Offload: Democratizing Billion-Scale Model Training', arXiv 2101.06840)"
DILOCO = "DiLoCo (Douillard et al., 'DiLoCo: Distributed Low-Communication Training of Language Models', " \
         "arXiv 2311.08105)"
LAWS = "Charles et al., 'Communication-Efficient Language Model Training Scales Reliably and Robustly: Scaling " \
       "Laws for DiLoCo', arXiv 2503.09799"
STREAMING = "Douillard et al., 'Streaming DiLoCo with overlapping communication: Towards a Distributed Free " \
            "Lunch', arXiv 2501.18512"
SPARSELOCO = "Sarfi et al., 'Communication Efficient LLM Pre-training with SparseLoCo', arXiv 2508.15706"
CO2 = "Sun et al., 'CO2: Efficient Distributed Training with Full Communication-Computation Overlap', " \
      "arXiv 2401.16265"
EDIT = "Cheng et al., 'EDiT: A Local-SGD-Based Efficient Distributed Training Method for Large Language Models', " \
       "arXiv 2412.07210"
DECOUPLED = "Decoupled DiLoCo (Google DeepMind, arXiv 2604.21428)"
PAPER = {"zero1": ZERO, "sync": ZERO, "dpu": OFFLOAD, "acco": ACCO, "acco adaptive": ACCO, "diloco": DILOCO,
         "streaming": STREAMING, "co2": CO2, "edit": EDIT, "a-edit": EDIT, "sparseloco": SPARSELOCO,
         "decoupled": DECOUPLED}

# Measured on the two-node testbed (0.84M GPT, 2 nodes of 2 ranks, target 1.01 x stock's final loss):
# docs/benchmarks/races.md, the race and the race with compression and Streaming DiLoCo; stock needed 245,760
# tokens in both.
MEASURED = {
    "zero1": (1.0, "definition (stock ZeRO-1 is the reference)"),
    "sync": (1.0, "exact: the same update as stock ZeRO-1 (tests check agreement with the simulator)"),
    "dpu": (278528 / 245760, "assumed = acco's (one-step-stale update, not raced)"),
    "acco": (278528 / 245760, "measured: race, acco fixed 278,528 / 245,760 tokens"),
    "acco int8": (278528 / 245760, "measured: race, acco fixed int8 278,528 / 245,760 tokens"),
    "acco adaptive": (278528 / 245760, "acco's x the micro-batch multiplier (race: 3.4-5.8x acco's tokens)"),
    "diloco": (524288 / 245760, "measured at H=8: race, 524,288 / 245,760 tokens"),
    "diloco int8": (655360 / 245760, "measured at H=8: race, diloco H=8 int8 655,360 / 245,760 tokens"),
    "streaming": (376832 / 245760, "measured at H=8, F=4, tau=1 and F=2, tau=2: 376,832 / 245,760 tokens"),
    "co2": (1015808 / 245760, "measured at H=8: race, 1,015,808 / 245,760 tokens"),
    "co2 int8": (917504 / 245760, "measured at H=8: race, co2 H=8 int8 917,504 / 245,760 tokens"),
    "edit": (458752 / 245760, "measured at H=8: race, 458,752 / 245,760 tokens"),
    "edit int8": (524288 / 245760, "measured at H=8: race, edit H=8 int8 524,288 / 245,760 tokens"),
    "a-edit": ((405504 + 499712) / 2 / 245760, "measured: race, A-EDiT T=5 s, mean of 200 and 50 Mbit"),
    "sparseloco": (524288 / 245760, "assumed = diloco's measured factor until measured"),
    "decoupled": (524288 / 245760, "assumed = diloco's measured factor: with K = all learners and no grace window "
                                   "decoupled is diloco (tests/test_decoupled.py)"),
}
TOKEN_FACTORS = MEASURED  # the names ``--token-factor`` accepts
# int8 factors not raced: the measured ratio of the nearest raced pair (round modes: acco fixed int8 / acco
# fixed = 1.00; local SGD: diloco H=8 int8 / diloco H=8 = 1.25).
INT8_PENALTY = {"round": (1.0, "x 1.00 = acco int8 / acco measured (not raced compressed)"),
                "local": (655360 / 524288, "x 1.25 = diloco H=8 int8 / diloco H=8 measured (not raced compressed)")}
PER_DOUBLING = 0.05  # the plan's assumption for DiLoCo beyond 2 replicas (no token factor in the paper)


def diloco_law(replicas: int):
    """(factor, source) of DiLoCo at M replicas from the scaling-laws paper: 1 at M <= 2; above, the stated
    assumption 1 + 0.05 log2(M/2), flat in model size and in the period."""
    if replicas <= 2:
        return 1.0, (f"{LAWS}: DiLoCo with M = 1-2 replicas matches or beats data-parallel loss at the same tokens "
                     f"(35M-2.4B trained, 4B and 10B extrapolated) and is robust to the period H: 1.00 at M = "
                     f"{replicas}, every H")
    f = 1.0 + PER_DOUBLING * math.log2(replicas / 2)
    src = (f"{LAWS}: for M = {replicas} replicas the paper reports a loss gap above data parallel that shrinks as "
           f"models grow, but gives no token factor: the plan assumes 1 + {PER_DOUBLING} log2(M/2) = {f:.3g}, held "
           f"flat in model size (pessimistic: the gap shrinks) and in H (robust to H)")
    if replicas > 8:
        src += f"; M = {replicas} is beyond the paper's M <= 8: the same assumption extended, not a published number"
    return f, src


def literature(fam: str, m, replicas: int):
    """(factor, source) of a row family from the papers (models of 100M parameters and more)."""
    base = fam.replace(" int8", "")
    if base in ("zero1", "sync"):
        f, src = 1.0, f"definition: the same update as stock ZeRO-1, {ZERO}"
    elif base in ("acco", "acco adaptive"):
        f, src = 1.0, (f"{ACCO}: its correction keeps the training dynamics aligned with ZeRO-1's at the same "
                       f"tokens (pretraining and fine-tuning runs): 1.00")
    elif base == "dpu":
        f, src = MEASURED["dpu"][0], (
            f"no token factor in the papers: {OFFLOAD} introduced one-step-delayed updates and reports baseline "
            f"convergence after a warm-up, {ACCO} reports them behind ZeRO-1; the plan keeps acco's factor "
            f"measured here ({MEASURED['acco'][1]})")
    else:
        f, src = diloco_law(replicas)
        if base == "streaming":
            src = (f"{STREAMING}: fragments with overlap reach DiLoCo's loss at the same tokens, so DiLoCo's "
                   f"factor; " + src)
            if m.delay > 1:
                src += f"; tau = {m.delay}: the paper's loss grows with tau and it gives no factor past 1: tau = 1's"
        elif base == "co2":
            src = (f"{CO2}: loss comparable to the data-parallel AdamW baseline in its runs, no token factor: the "
                   f"plan takes DiLoCo's (CO2 applies DiLoCo's outer step one period late); " + src)
        elif base in ("edit", "a-edit"):
            src = (f"{EDIT}: EDiT and A-EDiT reach loss at or below DiLoCo's in its runs, no token factor: the "
                   f"plan takes DiLoCo's (not lower); " + src)
        elif base == "decoupled":
            src = (f"{DECOUPLED}: with a quorum of all learners and no grace window it is DiLoCo, and the paper "
                   f"reports DiLoCo's quality; with K < M stale merges (Delayed Nesterov) have no published token "
                   f"factor: DiLoCo's; " + src)
        elif base == "sparseloco":
            src = (f"{SPARSELOCO}: lower loss than full-precision DiLoCo at H = 15-250 on a 512M model: the plan "
                   f"takes DiLoCo's (not lower); " + src)
    if fam.endswith(" int8"):
        if m.sync_every is not None:
            src += f"; int8 x 1.00: {STREAMING} sends outer gradients in 4 bits without measurable loss"
        else:
            src += f"; int8 x 1.00: no paper number for compressed rounds; {INT8_PENALTY['round'][1]} here"
    return f, src


def measured(fam: str, m):
    """(factor, source) from the races on the two-node testbed, the mode's paper named beside."""
    if fam in MEASURED:
        f, src = MEASURED[fam]
    else:
        f0, src0 = MEASURED[fam.replace(" int8", "")]
        pen, why = INT8_PENALTY["local" if m.sync_every else "round"]
        f, src = f0 * pen, src0 + "; " + why
    if m.sync_every is not None and m.sync_every != REFERENCE_H:
        f = 1.0 + (f - 1.0) * math.log2(m.sync_every) / math.log2(REFERENCE_H)
        src += f"; scaled to H={m.sync_every} by log2(H)/3"
    return f, src + f" (0.84M GPT; mode of {PAPER[fam.replace(' int8', '')]})"


def choice(inp) -> str:
    """``literature`` or ``measured``: the flag's, else by size (the papers from 100M parameters up)."""
    if inp.factor_source in ("literature", "measured"):
        return inp.factor_source
    return "literature" if inp.params >= LITERATURE_FROM else "measured"


def token_factor(inp, m, multiplier: float = 1.0):
    """(factor, source) of row ``m`` for ``inp`` (replicas M: its data-parallel nodes): the given override
    (read at H = 8 and scaled by log2(H)/3), else the literature's or the measured default."""
    fam = m.family
    if fam in inp.token_factors:
        f, src = inp.token_factors[fam], "given (--token-factor)"
        if m.sync_every is not None and m.sync_every != REFERENCE_H:
            f = 1.0 + (f - 1.0) * math.log2(m.sync_every) / math.log2(REFERENCE_H)
            src += f"; scaled to H={m.sync_every} by log2(H)/3"
        src += f" (mode of {PAPER[fam.replace(' int8', '')]})"
    elif choice(inp) == "literature":
        f, src = literature(fam, m, inp.dp_nodes)
    else:
        f, src = measured(fam, m)
    if multiplier != 1.0:
        f *= multiplier
        src += f"; x {multiplier:.2f} micro-batches"
    return f, src
