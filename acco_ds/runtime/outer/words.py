"""What a local-SGD outer loop says: its start-up words, summary lines and progress words (from
``LocalSGD.stats()`` and ``period_words()``), printed by every host as they are; a mode adds its own
lines in its class."""

from typing import List, Tuple


def _inner(loop) -> str:
    """What runs the inner steps of each replica: ZeRO-1 (flat buffers) or FSDP2 (its own shards)."""
    return "ZeRO-1" if loop.shards.flats is not None else "FSDP2"


def banner(loop) -> str:
    """The loop's words in the host's start-up line."""
    period = loop.period_words()[0]
    st = loop.settings
    outer = (f"outer=SGD lr={st['outer_lr']:g} momentum={st['outer_momentum']:g}"
             f"{' nesterov' if st['nesterov'] else ''}")
    return (f"replicas={loop.groups.replicas} x {loop.groups.k} ranks ({_inner(loop)} inside each) {period} {outer}"
            f"{'' if loop.compression is None else f' outer all-reduce {loop.compression.codec}'}"
            f"{'' if loop.outer_comm is None else ' outer communication overlapped'}{_fault_tolerance(loop)}")


def _fault_tolerance(loop) -> str:
    ft = loop.fault_tolerance
    if ft is None:
        return ""
    t = loop.transport
    return (f" fault tolerance: torchft replica {t.replica_id}, lighthouse {t.lighthouse}, min_replicas={ft.min_replicas}"
            f" merge={ft.merge}")


def report(loop) -> List[Tuple[str, str]]:
    """The summary lines of this mode, from ``stats()``."""
    s = loop.stats()
    period = loop.period_words()[1]
    who = (f"this replica of {s['replica_group_size']} rank(s) ({_inner(loop)} inside), the others joined by torchft"
           if loop.fault_tolerance is not None else
           f"{s['replicas']} replicas x {s['replica_group_size']} ranks ({_inner(loop)} inside each)")
    lines = [("replicas", f"{who}, {period}")]
    syncs = s["syncs"]
    hidden = s["outer_hidden_fraction"]
    overlap = ("blocking: nothing hidden" if loop.outer_comm is None else
               "n/a" if hidden is None else f"{100 * hidden:.0f}% hidden behind compute")
    per_sync = f"{s['outer_bytes'] / syncs / 2**20:.2f} MiB sent per sync by this rank (payload" \
               f"{'' if loop.compression is None else ', ' + str(loop.compression.codec)}), " if syncs else ""
    reads = s.get("read_syncs") or 0
    counted = f" over the {syncs - reads} syncs training collected ({reads} collected by a read)" if reads else ""
    lines.append(("outer syncs", f"{syncs} syncs, {per_sync}outer communication {s['outer_comm_s']:.2f} s"
                                 f"{counted}, {overlap} (waited {s['outer_wait_s']:.2f} s)"))
    if s.get("fault_tolerance"):
        lines.append(("fault tolerance", fault_tolerance_words(s)))
    return lines


def fault_tolerance_words(s: dict) -> str:
    """The summary line of a fault-tolerant loop: who took part in the syncs, what was discarded and healed."""
    who = ("no quorum yet" if s["participants_min"] is None else
           f"{s['participants_min']}/{s['participants_mean']:.1f}/{s['participants_max']} replicas per quorum "
           f"(min/mean/max)")
    return (f"replica {s['replica_id']}: {s['quorums']} quorums, {who}, {s['syncs_discarded']} syncs discarded, "
            f"{s['heals']} heals ({s['heal_bytes'] / 2**20:.2f} MiB, {s['heal_s']:.2f} s), "
            f"{s['quorum_wait_s']:.2f} s waiting for quorums, "
            + (f"{s['early_syncs']} period{'' if s['early_syncs'] == 1 else 's'} ended early for a joiner"
               if s["join"] == "early" else
               "joiners wait for the next sync"))


def progress(loop) -> str:
    """The loop's words in the host's progress line."""
    s = loop.stats()
    hidden = s["outer_hidden_fraction"]
    return (f"syncs={s['syncs']} outer_comm={s['outer_comm_s']:.2f}s waited={s['outer_wait_s']:.2f}s "
            f"hidden={'n/a' if hidden is None else f'{100 * hidden:.0f}%'}")


def sparse_banner(loop) -> str:
    """sparseloco's start-up words: no outer optimizer but averaged descent, and what travels."""
    bits = f"{loop.bits}-bit values" if loop.bits else "fp32 values"
    return (f"replicas={loop.groups.replicas} x {loop.groups.k} ranks ({_inner(loop)} inside each) "
            f"{loop.period_words()[0]} outer=averaged descent lr={loop.settings['outer_lr']:g} sparse: top "
            f"{loop.topk} of every {loop.chunk} elements, {bits}, error feedback decay {loop.decay:g}"
            f"{f', all-gather behind the next {loop.overlap} inner step(s)' if loop.overlap else ''}")


def sparse_words(s: dict) -> str:
    """sparseloco's summary line, from ``stats()``: density, bits, bytes per sync, residual norm."""
    bits = f"{s['sparse_value_bits']}-bit values" if s["sparse_value_bits"] else "fp32 values"
    dense, packed, wire = s["sparse_dense_bytes"], s["sparse_payload_bytes"], s.get("sparse_wire_bytes")
    sent = wire if wire else packed  # before the first sync: the packed size
    ratio = f", {dense / sent:.0f}x fewer than its fp32 pseudo-gradient" if sent else ""
    coded = f"{wire:,} bytes zlib-coded at the last sync ({packed:,} packed)" if wire and wire != packed \
        else f"{packed:,} bytes packed"
    index = (max(s["sparse_chunk"], 2) - 1).bit_length()
    norm = s["sparse_residual_norm"]
    return (f"top {s['sparse_topk']} of every {s['sparse_chunk']} elements (density {100 * s['sparse_density']:.2f}%), "
            f"{bits} + {index}-bit indices + an fp32 scale per chunk: {coded} per sync handed to the all-gather "
            f"by this rank{ratio}; error feedback decay {s['sparse_error_decay']:g}, "
            f"residual norm {'n/a (no sync yet)' if norm is None else f'{norm:.4g}'} (the parameters this rank's "
            f"replica group holds, after the last sync); {s['sparse_boundary_bytes']:,} bytes traded inside the replica for chunks across partitions")


__all__ = ["banner", "report", "progress", "fault_tolerance_words", "sparse_banner", "sparse_words"]
