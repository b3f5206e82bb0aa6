"""acco_ds.collectives on W = 2, 3, 4 gloo CPU ranks.

Each test starts W processes running this file as a script (``python
test_collectives.py CASE``); a rank that fails an assertion exits non-zero and
the test shows its log. Every rank builds every rank's input from a seed, so
it can compute the expected sum itself.
"""

import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORLDS = [2, 3, 4]


# ----------------------------------------------------------------- helpers
def inputs(world, numel, dtype, seed, integers=False):
    """Every rank's input (W*numel elements each), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    if integers:
        return [torch.randint(-8, 9, (world * numel,), generator=g).to(dtype) for _ in range(world)]
    return [torch.randn(world * numel, generator=g).to(dtype) for _ in range(world)]


def rank_order_sum(xs, rank, numel):
    """((x_0 + x_1) + x_2) + ... of the slice ``rank`` owns, in the inputs' dtype."""
    parts = [x[rank * numel:(rank + 1) * numel] for x in xs]
    total = parts[0].clone()
    for p in parts[1:]:
        total = total + p
    return total


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))


def native_reduce_scatter(out, inp):
    import torch.distributed as tdist
    fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    fn(out, inp, op=tdist.ReduceOp.SUM)


# ------------------------------------------------------------ rank-side cases
def case_fp32_chunks(rank, world):
    """Random fp32, P not a multiple of the chunk, several chunks; rank-order sum bit for bit."""
    from acco_ds.runtime.comm.collectives import reduce_scatter
    numel = 1000
    for chunk in (96, 1, 999, 1000, 5000):
        xs = inputs(world, numel, torch.float32, seed=chunk)
        x = xs[rank].clone()
        out = torch.full((numel,), float("nan"))
        assert reduce_scatter(out, x, None, chunk_elems=chunk) is None
        assert same_bits(x, xs[rank]), "input was modified"
        assert same_bits(out, rank_order_sum(xs, rank, numel)), f"chunk {chunk}"
        if world == 2:  # a sum of two is order independent: equal to torch's own, bit for bit
            ref = torch.empty(numel)
            native_reduce_scatter(ref, x)
            assert same_bits(out, ref)


def case_odd_sizes(rank, world):
    """Padded-partition sizes: P odd (13, 1, 7), chunks smaller and larger than P."""
    from acco_ds.runtime.comm.collectives import reduce_scatter
    for numel, chunk in ((13, 4), (13, 13), (13, 1 << 18), (1, 1), (7, 2)):
        xs = inputs(world, numel, torch.float32, seed=numel * 100 + chunk)
        out = torch.empty(numel)
        reduce_scatter(out, xs[rank].clone(), None, chunk_elems=chunk)
        assert same_bits(out, rank_order_sum(xs, rank, numel)), (numel, chunk)


def case_half(rank, world):
    """bf16 and fp16: summed in that dtype, rounding after each addition, like gloo."""
    from acco_ds.runtime.comm.collectives import reduce_scatter
    numel = 301
    for dtype in (torch.bfloat16, torch.float16):
        xs = inputs(world, numel, dtype, seed=7)
        x = xs[rank].clone()
        out = torch.empty(numel, dtype=dtype)
        reduce_scatter(out, x, None, chunk_elems=64)
        assert same_bits(x, xs[rank])
        expect = rank_order_sum(xs, rank, numel)
        assert same_bits(out, expect), dtype
        # not an fp32 accumulation rounded once (that differs somewhere for W >= 3)
        if world >= 3:
            wide = sum(x_[rank * numel:(rank + 1) * numel].float() for x_ in xs).to(dtype)
            assert not same_bits(wide, expect)
        if world == 2 and dtype == torch.bfloat16:
            ref = torch.empty(numel, dtype=dtype)
            native_reduce_scatter(ref, x)
            assert same_bits(out, ref)


def case_vs_native(rank, world):
    """Against torch's reduce_scatter_tensor on gloo, bit for bit: on small integers for every W and dtype
    (exact sums, order does not matter), on random floats for W = 2. For W >= 3 and random floats gloo's
    order (its all-reduce ring) is not rank order: record how many elements differ, for information."""
    from acco_ds.runtime.comm.collectives import reduce_scatter
    numel = 777
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = inputs(world, numel, dtype, seed=3, integers=True)
        out, ref = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        reduce_scatter(out, xs[rank].clone(), None, chunk_elems=100)
        native_reduce_scatter(ref, xs[rank].clone())
        assert same_bits(out, ref), dtype
    xs = inputs(world, numel, torch.float32, seed=4)
    out, ref = torch.empty(numel), torch.empty(numel)
    reduce_scatter(out, xs[rank].clone(), None, chunk_elems=100)
    native_reduce_scatter(ref, xs[rank].clone())
    if world == 2:
        assert same_bits(out, ref)
    else:
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
        print(f"rank {rank}/{world}: {(out != ref).sum().item()} of {numel} fp32 elements differ from torch's "
              f"reduce_scatter_tensor (different sum order)")


def case_async_and_gather(rank, world):
    """async_op handle; all_gather out of place and in place; reduce-scatter then all-gather into the same
    storage that was the reduce-scatter input (the ZeRO-1 pattern)."""
    import torch.distributed as tdist

    from acco_ds.runtime.comm.collectives import all_gather, reduce_scatter
    numel = 13
    xs = inputs(world, numel, torch.float32, seed=11)
    buf = xs[rank].clone()
    shard = torch.empty(numel)
    work = reduce_scatter(shard, buf, None, chunk_elems=5, async_op=True)
    assert work.wait() and work.is_completed()
    assert same_bits(shard, rank_order_sum(xs, rank, numel))
    full = torch.cat([rank_order_sum(xs, r, numel) for r in range(world)])
    # out of place
    gathered = torch.full((world * numel,), float("nan"))
    all_gather(gathered, shard, None)
    assert same_bits(gathered, full)
    # in place, into the reduce-scatter input's storage
    buf[rank * numel:(rank + 1) * numel].copy_(shard)
    work = all_gather(buf, buf[rank * numel:(rank + 1) * numel], None, async_op=True)
    work.wait()
    assert same_bits(buf, full)
    for dtype in (torch.bfloat16, torch.float16):
        b = torch.full((world * numel,), float("nan"), dtype=dtype)
        b[rank * numel:(rank + 1) * numel] = torch.arange(numel, dtype=dtype) + rank
        all_gather(b, b[rank * numel:(rank + 1) * numel], None)
        assert same_bits(b, torch.cat([torch.arange(numel, dtype=dtype) + r for r in range(world)]))
    # a subgroup (ranks 0 and 1), and an empty partition
    sub = tdist.new_group([0, 1])
    if rank < 2:
        ys = inputs(2, 9, torch.float32, seed=5)
        out = torch.empty(9)
        reduce_scatter(out, ys[rank].clone(), sub, chunk_elems=4)
        assert same_bits(out, rank_order_sum(ys, rank, 9))
    reduce_scatter(torch.empty(0), torch.empty(0), None)
    tdist.barrier()


def case_hierarchical(rank, world):
    """Node-aware reduce-scatter and all-gather (NodeLayout): on 4 ranks as 2 nodes of 2, the sum in node
    order bit for bit (node sums in local-rank order, then over nodes), exact for integers, and the all-gather
    in place; groups on one node, with one rank per node or with uneven nodes get no layout (flat)."""
    import torch.distributed as tdist

    from acco_ds.runtime.comm.collectives import all_gather, node_layout, reduce_scatter
    layout = node_layout([list(range(world))], 2, flat=None)
    assert node_layout([list(range(world))], world) is None  # one node
    assert node_layout([list(range(world))], 1) is None  # one rank per node
    if world != 4:
        assert layout is None, layout  # 2 ranks: one node of 2; 3 ranks: nodes of 2 and 1
        return
    assert (layout.nodes, layout.per_node) == (2, 2) and str(layout) == "hierarchical (2 nodes x 2 ranks)"
    assert node_layout([[0, 2], [1, 3]], 2) is None  # each group has one rank per node
    numel = 1000
    for dtype, integers in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        xs = inputs(world, numel, dtype, seed=11, integers=integers)
        out = torch.empty(numel, dtype=dtype)
        reduce_scatter(out, xs[rank].clone(), layout, chunk_elems=96)
        mine = [x[rank * numel:(rank + 1) * numel] for x in xs]
        want = (mine[0] + mine[1]) + (mine[2] + mine[3])  # node 0's sum, then node 1's
        assert same_bits(out, want), (dtype, integers, (out.double() - want.double()).abs().max())
        if integers:
            assert same_bits(out, rank_order_sum(xs, rank, numel))
        full = torch.cat([xs[r][:numel] for r in range(world)])
        buf = torch.full((world * numel,), float("nan"), dtype=dtype)
        buf[rank * numel:(rank + 1) * numel] = xs[rank][:numel]
        all_gather(buf, buf[rank * numel:(rank + 1) * numel], layout)
        assert same_bits(buf, full)
    tdist.barrier()


def _quantized(x, res, block, dtype="int8"):
    """What a compressed send of ``x`` (+ ``res``, updated in place) delivers: the dequantized values."""
    from acco_ds.ops import reference as R
    q = torch.empty(x.numel(), dtype=R.WIRE_DTYPES[dtype])
    s = torch.empty(R.num_blocks(x.numel(), block))
    R.quantize_pack(x, res, q, s, block_size=block)
    out = torch.zeros(x.numel())
    R.dequantize_accumulate(q, s, out, block_size=block)
    return out


def case_compressed(rank, world):
    """Quantized reduce-scatter, all-gather and all-reduce (runtime.compression): every rank computes what
    each send must deliver with the reference quantizer (per chunk, per block, residuals included) and
    checks the collective bit for bit; all-gathered copies are identical on every rank; with error
    feedback, two rounds of the same input deliver its double to within one round's error."""
    import torch.distributed as tdist

    from acco_ds import ops
    from acco_ds.runtime.comm import compression
    from acco_ds.runtime.comm.collectives import node_layout
    block, chunk, numel = 16, 48, 100  # chunk: 3 blocks; numel: 2 full chunks and a short one
    layouts = [("flat", None)]
    if world == 4:
        layouts.append(("hierarchical", node_layout([list(range(world))], 2)))
    for dtype in ("int8", "fp8"):
        codec = compression.Codec(dtype, block, ops.TORCH, chunk_elems=chunk)
        for name, layout in layouts:
            group = layout if layout is not None else tdist.group.WORLD
            xs = inputs(world, numel, torch.float32, seed=5)
            peers = world if layout is None else layout.nodes  # ranks of the quantized step
            residual = torch.zeros(compression.rs_residual_elems(peers, numel))
            out = torch.empty(numel)
            for _ in range(2):  # the second round adds the first round's residuals
                compression.reduce_scatter(out, xs[rank], group, codec, residual)
            # Expected, from every rank's inputs: the same sends, rank by rank (node sums for the layout).
            if layout is None:
                senders, me = [x.view(world, numel) for x in xs], rank
            else:
                k, i = layout.per_node, rank % layout.per_node
                node_sum = lambda n: xs[n * k].view(world, numel) + xs[n * k + 1].view(world, numel)  # noqa: E731
                senders = [node_sum(n)[[n2 * k + i for n2 in range(layout.nodes)]] for n in range(layout.nodes)]
                me = rank // k
            want = torch.zeros(numel)
            for start in range(0, numel, chunk):
                m = min(chunk, numel - start)
                res = [torch.zeros(m) for _ in senders]
                for _ in range(2):
                    part = torch.zeros(m)
                    for r, x in enumerate(senders):
                        src = x[me, start:start + m]
                        part += src if r == me else _quantized(src, res[r], block, dtype)
                want[start:start + m] = part
            assert same_bits(out, want), (dtype, name, (out - want).abs().max())
            exact = sum(x.view(world, numel)[rank] for x in xs)
            assert (out - exact).abs().max() < 0.2 * exact.abs().max(), (dtype, name)

            # All-gather of updates: current + deq(Q(target_r - current_r)) everywhere, the owner too.
            current = inputs(world, numel, torch.float32, seed=6)[0]  # the same copy on every rank
            targets = inputs(world, numel, torch.float32, seed=7)
            buf = current.clone()
            compression.all_gather(buf, buf, targets[rank][:numel].clone(), group, codec)
            gathered = [torch.empty_like(buf) for _ in range(world)]
            tdist.all_gather(gathered, buf)
            assert all(same_bits(g, buf) for g in gathered), "ranks hold different copies"
            for r in range(world):
                cur = current[r * numel:(r + 1) * numel]
                want = cur.clone()
                for start in range(0, numel, chunk):
                    m = min(chunk, numel - start)
                    want[start:start + m] += _quantized(targets[r][start:start + m] - cur[start:start + m],
                                                        None, block, dtype)
                assert same_bits(buf[r * numel:(r + 1) * numel], want), (dtype, name, r)

        # All-reduce (the outer pseudo-gradient): the mean, quantized both ways, the same on every rank.
        t = inputs(world, 37, torch.float32, seed=8)[rank][:37].clone()
        mean = sum(inputs(world, 37, torch.float32, seed=8)[r][:37] for r in range(world)) / world
        res = torch.zeros(compression.all_reduce_residual_elems(world, 37))
        compression.all_reduce([t], tdist.group.WORLD, codec, [res], divide_by=world)
        everyone = [torch.empty_like(t) for _ in range(world)]
        tdist.all_gather(everyone, t)
        assert all(same_bits(e, t) for e in everyone)
        assert (t - mean).abs().max() < 0.1 * mean.abs().max() + 1e-6, (dtype, (t - mean).abs().max())
    tdist.barrier()


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def worker(cases):
    """Run the comma-separated ``cases`` in order on one process group, saying ``case ok NAME`` after each;
    the first failure ends the rank (its peers then fail or time out)."""
    import torch.distributed as tdist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for case in cases.split(","):
            CASES[case](rank, world)
            tdist.barrier()
            print(f"case ok {case}", flush=True)
    finally:
        tdist.destroy_process_group()


# --------------------------------------------------------------- test side
def launch(case, world, timeout=100.0):
    """Run ``case`` (or several, comma-separated) on ``world`` ranks; each rank's log, or an error with
    their tails when any rank failed."""
    from dist import free_port
    path = os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=path)
    with tempfile.TemporaryDirectory(prefix="acco_coll_") as tmp:
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, __file__, case], env={**env, "RANK": str(r)}, stdout=logs[r],
                                  stderr=subprocess.STDOUT) for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"{case} on {world} ranks: exit codes {codes}\n" +
                             "\n".join(f"--- rank {r} ---\n{t[-3000:]}" for r, t in enumerate(texts)))
    return texts


_LAUNCHED = {}  # world -> every rank's log, or the error of the launch that ran every case


def all_cases(world):
    """One launch per world size runs every case in turn (one process start instead of one per case)."""
    if world not in _LAUNCHED:
        try:
            _LAUNCHED[world] = launch(",".join(sorted(CASES)), world, timeout=240.0)
        except AssertionError as err:
            _LAUNCHED[world] = err
    return _LAUNCHED[world]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_collectives(case, world):
    texts = all_cases(world)
    if isinstance(texts, AssertionError):
        if f"case ok {case}" not in str(texts):  # this case failed, or never ran after another failed
            raise texts
        return  # this case passed before another failed
    for t in texts:
        assert f"case ok {case}" in t, t[-3000:]
        for line in t.splitlines():
            if line.startswith("rank "):
                print(line)


def test_is_gloo_parses_backends(monkeypatch):
    import torch.distributed as tdist

    from acco_ds.runtime.comm import collectives
    cases = [("gloo", True, True), ("nccl", False, False), ("cpu:gloo,cuda:nccl", True, False),
             ("cuda:nccl,cpu:gloo", True, False), ("cpu:gloo,cuda:gloo", True, True)]
    for backend, cpu, cuda in cases:
        monkeypatch.setattr(tdist, "get_backend", lambda group=None, b=backend: b)
        assert collectives._is_gloo(None, torch.device("cpu")) == cpu, backend
        assert collectives._is_gloo(None, torch.device("cuda")) == cuda, backend

if __name__ == "__main__":
    worker(sys.argv[1])
