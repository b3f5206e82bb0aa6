"""Who gets into a syncer shard of ``"mode": "decoupled"``: only a peer that holds the secret file (CURVE keys
derived from it, admitted by the shard's ZAP guard), within the shard's caps. A peer without the secret, or with
another one, is refused at the handshake with an error that names auth on its side, and nothing changes; the
secret file is checked by name; the secret never shows in what the shard writes."""

import os
import socket
import threading
import time

import pytest
import torch
import zmq

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.syncer import Shard

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "syncer.key"
    transport.make_secret(str(path))
    return path


def run_shard(tmp_path, keys, lines=None, **kw):
    s = Shard(0, "127.0.0.1", 0, SETTINGS, grace_s=0.0, state_dir=str(tmp_path / "state"), keys=keys,
              say=(lines.append if lines is not None else (lambda _: None)), **kw)
    s.start()
    t = threading.Thread(target=s.serve, daemon=True)
    t.start()
    return s, t


def join(shard, i, keys, incarnation=1):
    link = Link(("127.0.0.1", shard.port), i, incarnation, 0, 3, 1 << 20, keys)
    version = link.open(3)
    if version == wire.NO_VERSION:
        link.send(link.mine("INIT", name="theta", tensor=torch.ones(4)))
    return link


def test_make_secret_writes_32_owner_only_random_bytes_and_refuses_to_overwrite(tmp_path, secret):
    assert os.stat(secret).st_mode & 0o777 == 0o600 and len(secret.read_bytes()) == 32
    assert transport.check_secret_file(str(secret)) == secret.read_bytes()
    with pytest.raises(FileExistsError):
        transport.make_secret(str(secret))
    other = tmp_path / "other.key"
    transport.make_secret(str(other))
    assert other.read_bytes() != secret.read_bytes()


@pytest.mark.parametrize("make, needle", [
    (lambda p: None, "No such file"),
    (lambda p: (p.write_bytes(os.urandom(32)), p.chmod(0o644)), "readable by others (mode 0o644): run `chmod 600"),
    (lambda p: (p.write_bytes(b"short"), p.chmod(0o600)), "holds 5 bytes, at least 32 random bytes"),
])
def test_a_bad_secret_file_is_refused_by_name(tmp_path, make, needle):
    path = tmp_path / "key"
    make(path)
    with pytest.raises(ValueError) as err:
        transport.check_secret_file(str(path))
    assert needle in str(err.value) and str(path) in str(err.value)


def test_a_shard_off_loopback_without_a_secret_refuses_to_start():
    with pytest.raises(ValueError, match="without a secret: give it --auth-file"):
        Shard(0, "0.0.0.0", 0, SETTINGS, say=lambda _: None)


def test_peers_without_the_secret_or_with_another_are_refused_and_change_nothing(tmp_path, secret):
    keys = transport.load_keys(str(secret))
    lines = []
    shard, t = run_shard(tmp_path, keys, lines)
    try:
        a = join(shard, 0, keys)
        a.send(a.mine("GET"))
        assert a.recv("PARAMS", "theta", 4).version == 0
        other = transport.Keys(os.urandom(32))
        for peer_keys, mine in ((None, "this side has no auth_file"), (other, "this side has local_sgd.syncer")):
            with pytest.raises(transport.AuthError) as err:
                join(shard, 1, peer_keys)
            assert "auth failed with syncer shard 0" in str(err.value) and mine in str(err.value)
        # A peer with the right public key of the shard but a key pair of its own: the guard refuses it.
        rogue = transport.client(zmq.Context.instance(), keys, "127.0.0.1", shard.port, 1 << 20, 3)
        rogue.setsockopt(zmq.CURVE_PUBLICKEY, other.client_public)
        rogue.setsockopt(zmq.CURVE_SECRETKEY, other.client_secret)
        with pytest.raises(transport.AuthError, match="refused this side's key"):
            transport.handshake(rogue, transport.endpoint("127.0.0.1", shard.port), 3, "syncer shard 0", True)
        rogue.close(0)
        # Plain TCP bytes and a FOLLOW from outside reach nothing; the shard serves on.
        raw = socket.create_connection(("127.0.0.1", shard.port))
        raw.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x7f" + bytes(wire.encode(wire.Message("FOLLOW"))[0]))
        outsider = zmq.Context.instance().socket(zmq.DEALER)
        outsider.setsockopt(zmq.LINGER, 0)
        outsider.connect(transport.endpoint("127.0.0.1", shard.port))
        outsider.send_multipart(wire.encode(wire.Message("FOLLOW", version=0)))
        time.sleep(0.5)
        assert not shard.followers and shard.guard.refused >= 1 and shard.refused == 0
        a.send(a.mine("GET"))
        assert a.recv("PARAMS", "theta", 4).version == 0 and torch.equal(shard.state.x, torch.ones(4))
        raw.close()
        outsider.close(0)
        a.send(a.mine("DELTA", base=0, tokens=1, steps=1, name="delta", tensor=torch.ones(4)))
        a.recv("ACK")
        a.send(a.mine("READY", base=0, steps=1))
        a.waiting_base = 0
        assert a.recv_params(4).version == 1
    finally:
        shard.stop()
        t.join(5)
    # The secret shows nowhere the shard writes: its log lines, checkpoint, merge and decision logs.
    written = "\n".join(lines).encode() + b"".join(p.read_bytes() for p in (tmp_path / "state").iterdir())
    raw_secret = secret.read_bytes()
    for form in (raw_secret, raw_secret.hex().encode(), keys.server_secret, keys.client_secret):
        assert form not in written


def test_max_learners_and_the_connection_cap_refuse_by_name(tmp_path, secret):
    keys = transport.load_keys(str(secret))
    shard, t = run_shard(tmp_path, keys, max_learners=1, max_connections=3)
    try:
        join(shard, 0, keys)
        extra = Link(("127.0.0.1", shard.port), 1, 1, 0, 3, 1 << 20, keys)
        with pytest.raises(wire.Refused, match="this syncer admits 1 \\(--max-learners\\)"):
            extra.open(3)
        extra.close()
        time.sleep(0.3)
        idle = [socket.create_connection(("127.0.0.1", shard.port)) for _ in range(4)]
        time.sleep(0.3)
        with pytest.raises(transport.AuthError, match="connection cap"):
            join(shard, 0, keys, incarnation=2)
        for s in idle:
            s.close()
        time.sleep(0.3)
        join(shard, 0, keys, incarnation=3)  # room again once they are gone
    finally:
        shard.stop()
        t.join(5)


def test_the_command_refuses_a_public_address_without_a_secret_and_makes_secrets(tmp_path, capsys):
    import json

    from acco_ds.cli.syncer import main
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "acco": {"enabled": True, "mode": "decoupled"}}))
    with pytest.raises(SystemExit) as err:
        main(["--config", str(cfg), "--shards", "1", "--port", "29999", "--host", "0.0.0.0"])
    assert "--host 0.0.0.0 is not loopback: give --auth-file PATH" in str(err.value)
    key = tmp_path / "k"
    key.write_bytes(os.urandom(40))
    key.chmod(0o640)
    with pytest.raises(SystemExit) as err:
        main(["--config", str(cfg), "--shards", "1", "--port", "29999", "--host", "0.0.0.0", "--auth-file", str(key)])
    assert "readable by others" in str(err.value) and "chmod 600" in str(err.value)
    assert main(["--make-secret", str(tmp_path / "new.key")]) == 0
    assert os.stat(tmp_path / "new.key").st_mode & 0o777 == 0o600
    with pytest.raises(SystemExit, match="exists; remove it first"):
        main(["--make-secret", str(tmp_path / "new.key")])
    assert (tmp_path / "new.key").read_bytes().hex() not in capsys.readouterr().out
