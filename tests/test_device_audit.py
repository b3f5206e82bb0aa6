"""Every collective acco_ds issues would be valid on NCCL: no host tensor reaches a collective.

NCCL refuses CPU tensors; on a GPU host a tensor made by a torch factory without ``device=`` is a CPU
tensor. ``tests/device_audit.py`` marks such tensors made by acco_ds and records every collective, so
this runs on CPU/gloo (no GPU): the save, load and read paths of acco, the local-SGD modes and A-EDiT (its
checkpoint tag is agreed with an all-reduce) on 4 ranks as 2 replicas of 2.
"""

import os

import pytest
import torch
import torch.distributed as tdist

import common
import device_audit
from dist import launch

GAS = 2


def test_the_audit_flags_a_host_tensor_made_without_device_and_passes_the_rest(tmp_path):
    own = not tdist.is_initialized()  # another test module of this process may hold a 1-rank group already
    if own:
        tdist.init_process_group("gloo", store=tdist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    audit = device_audit.DeviceAudit(package=os.path.dirname(os.path.abspath(__file__)) + os.sep).install()
    try:
        on_device = torch.zeros(3, device="cpu")  # explicit device: what the host's tensors are
        derived = torch.zeros_like(on_device)  # derived from a host tensor: same device
        tdist.all_reduce(on_device)
        tdist.all_reduce(derived)
        assert audit.report()["violations"] == []
        host = torch.tensor([1.0])  # no device: a CPU tensor on a GPU host, refused by NCCL
        tdist.all_reduce(host)
    finally:
        audit.uninstall()
        if own:
            tdist.destroy_process_group()
    report = audit.report()
    assert len(report["violations"]) == 1 and "all_reduce" in report["violations"][0]
    assert "host = torch.tensor([1.0])" in report["violations"][0]  # names the line that made it
    assert report["package_collectives"] == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_save_load_and_read_paths_of_every_mode_would_be_valid_on_nccl(tmp_path):
    local = lambda mode, **ls: {"mode": mode, "local_sgd": {"replica_group_size": 2, **ls}}  # noqa: E731
    configs = {
        "acco": common.ds_config(acco={"mode": "acco"}, gas=GAS, clip=0.05),
        "acco adaptive": common.ds_config(acco={"mode": "acco", "accumulation": "adaptive"}, gas=GAS),
        "diloco": common.ds_config(acco=local("diloco", sync_every=2), gas=GAS),
        "co2": common.ds_config(acco=local("co2", sync_every=2), gas=GAS),
        "edit": common.ds_config(acco=local("edit", sync_every=2, weighting="norm", pseudo_grad_clip=0.01,
                                            anomaly={"enabled": True, "warmup_syncs": 2}), gas=GAS),
        "a-edit": common.ds_config(acco=local("edit", sync_time_s=9.0), gas=GAS),  # as test_edit
        # Compressed rounds and outer all-reduce: quantize, all-to-all, all-gather of the wire bytes.
        "acco int8": common.ds_config(acco={"mode": "acco", "compression": {"dtype": "int8", "apply_to": ["rounds"]}},
                                      gas=GAS),
        "diloco int8": common.ds_config(acco={**local("diloco", sync_every=2), "compression": {
            "dtype": "int8", "apply_to": ["rounds", "outer"]}}, gas=GAS),
    }
    ckpt = {name: str(tmp_path / name.replace(" ", "_")) for name in configs}

    def run(name, **extra):
        if name == "a-edit":  # periods on an injected clock; the save has no tag (the all-reduced one)
            return dict(config=configs[name], steps=10**6, until_syncs=2, extra_micro=GAS,
                        fake_clock=[1.0, 1.0, 1.0, 2.0], **extra)
        if name.startswith("acco"):  # state_dict, eval, save in the middle of training, then finalize
            return dict(config=configs[name], steps=6, read_every=3, save_at_read=1, finalize=True, **extra)
        return dict(config=configs[name], steps=5, record_committed=True, finalize=True, **extra)

    saved = launch({"device_audit": True, "runs": [run(n, save=ckpt[n]) for n in configs]}, world_size=4,
                   timeout=500)
    loaded = launch({"device_audit": True, "runs": [run(n, load=ckpt[n]) for n in configs if n != "a-edit"] +
                     [dict(run("a-edit", load=ckpt["a-edit"]), until_syncs=3)]}, world_size=4, timeout=500)
    for results in (saved, loaded):
        for rank in range(4):
            report = results[rank][-1]["device_audit"]
            assert report["violations"] == [], "\n".join(report["violations"])
            # The audit saw acco_ds's own collectives, of every kind the modes use.
            assert report["package_collectives"] > 50, report
            ops = set(report["ops"])
            assert {"all_reduce", "all_to_all_single", "all_gather"} <= ops, report
            assert ops & {"all_gather_into_tensor", "all_gather_single"}, report  # the flat all-gather
    assert all(r.get("loaded") for r in loaded[0][:-1]), "a run did not load its checkpoint"
