"""Checkpoint files read without running code: ``torch.load(weights_only=True)``.

A ``.pt`` file is a pickle, and a pickle may name any importable callable and call it while it loads: a
checkpoint from a model hub, a bucket or a colleague could run a command on every rank that reads it.
``weights_only=True`` (torch's default since 2.6) loads with an unpickler that builds only tensors, numbers,
strings, ``None``, lists, tuples, sets and dicts (also ``OrderedDict``), torch dtypes, devices and sizes,
plus the classes a caller lists (``allowed``: plain data types such as DeepSpeed's loss scaler, whose state
is a dict of numbers). Everything acco_ds reads of its own goes through ``load_safely``; a file that holds
anything else is refused by name, never read again unsafely (that retry would be the very hole).

What acco_ds writes is checked the same way before it is written (``check_safe``): a user's extras that a
safe load would refuse are refused at ``save``, when they can still be fixed, not at ``load``.
"""

import io
import pickle
import re

import torch

ACCEPTS = ("tensors, numbers, strings, None, and lists, tuples, sets and dicts of them (torch dtypes and "
           "devices too)")


class UnsafeCheckpointFile(pickle.UnpicklingError):
    """A checkpoint file holds objects that ``torch.load(weights_only=True)`` does not build."""


def reason(err: Exception) -> str:
    """torch's reason for refusing a weights-only load, without its advice to load unsafely."""
    text = str(err)
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", text)
    return (found.group(1) if found else text.strip().splitlines()[-1]).rstrip(".")


def load_safely(name, allowed=(), mmap: bool = False):
    """``torch.load(name, weights_only=True)`` onto the CPU, also building the classes ``allowed``; a file
    that holds anything else raises ``UnsafeCheckpointFile`` naming it. Other failures (a missing,
    truncated or corrupted file) pass through for the caller to name."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(name, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(
            f"{name} holds objects a safe load does not accept: {reason(err)}. acco_ds reads checkpoint files "
            f"with torch.load(weights_only=True), which builds only {ACCEPTS}, so that a file cannot run code "
            f"when it is loaded; it never retries unsafely. Use a checkpoint written by acco_ds from a source "
            f"you trust, or an earlier one") from err


def check_safe(value, what: str) -> None:
    """Raise ``ValueError`` if ``value``, once saved, would not load with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{what} holds objects a safe load does not accept: {reason(err)}. Checkpoints are "
                         f"loaded with torch.load(weights_only=True) so that loading one cannot run code, and that "
                         f"builds only {ACCEPTS}: store other objects as those (a numpy array as a tensor, an "
                         f"object as its state dict)") from None


__all__ = ["ACCEPTS", "UnsafeCheckpointFile", "check_safe", "load_safely", "reason"]
