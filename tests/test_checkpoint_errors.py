"""A failed save or load names its real cause: a failed peer is not a full disk or a corrupt file."""

import pytest

from acco_ds.deepspeed.checkpoint import load_errors, save_errors

PEER = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:48525"


def test_a_peer_failing_during_save_is_named_as_such(tmp_path):
    with pytest.raises(RuntimeError) as err:
        with save_errors(tmp_path):
            raise RuntimeError(PEER)
    text = str(err.value)
    assert "failed because another rank failed or lost its network during the save" in text
    assert "disk full" not in text and "Connection closed by peer" in text


def test_a_full_disk_is_named_with_the_free_space(tmp_path):
    for cause in (OSError(28, "No space left on device"), RuntimeError("[enforce fail at inline_container.cc:626]")):
        with pytest.raises(RuntimeError) as err:
            with save_errors(tmp_path):
                raise cause
        assert "is the disk full? (free space there:" in str(err.value) and "MiB" in str(err.value)


def test_other_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(RuntimeError, match="^something else$"):
        with save_errors(tmp_path):
            raise RuntimeError("something else")


def test_load_names_a_failed_peer_and_a_damaged_file(tmp_path):
    with pytest.raises(RuntimeError, match="another rank failed or lost its network during the load"):
        with load_errors(tmp_path, None):
            raise RuntimeError(PEER)
    with pytest.raises(RuntimeError, match="A file is probably truncated or corrupted"):
        with load_errors(tmp_path, "global_step4"):
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
