"""Committed-weight views: point the module's parameters at another flat buffer.

Every host keeps each parameter as a view into a flat buffer (ZeRO-1's
``bit16_groups_flat``, the torch host's own flats). While the compute side
works at an estimate θ̃ (or at θ_t while the commit θ_{t+1} waits in the
all-gather buffer), the committed weights already sit in a flat buffer of the
same layout. Showing them to a reader is re-pointing each ``param.data`` at
the same offsets of that buffer: no copy, no memory.
"""

from typing import List, Optional, Tuple

import torch


class ParamView:
    """Nested re-pointing of a host's parameters.

    Args:
        params: per flat buffer, its parameters with their element offsets (``outer_loop.Shards.params``).
        compute_flats: the flat buffers where the parameters live normally.
    """

    def __init__(self, params: List[List[Tuple[torch.Tensor, int]]], compute_flats: List[torch.Tensor]):
        self.params, self.compute_flats = params, compute_flats
        self.depth = 0  # nesting of show() calls (a read of the committed weights is in progress)
        self._pointed = False  # the parameters point at other buffers than compute_flats

    def _point(self, flats: List[torch.Tensor]) -> None:
        for flat, params in zip(flats, self.params):
            for p, offset in params:
                p.data = flat.narrow(0, offset, p.numel()).view(p.shape)

    def show(self, flats: Optional[List[torch.Tensor]]) -> None:
        """Point the parameters at ``flats`` (None: they already hold what is
        to be shown) until the matching ``restore()``; nests (an inner call
        keeps what the outer one shows)."""
        if self.depth == 0 and flats is not None:
            self._point(flats)
            self._pointed = True
        self.depth += 1

    def restore(self, all_levels: bool = True) -> None:
        if self.depth == 0:
            return
        self.depth = 0 if all_levels else self.depth - 1
        if self.depth == 0 and self._pointed:
            self._point(self.compute_flats)
            self._pointed = False


__all__ = ["ParamView"]
