"""Committed-weight views: point the module's parameters at another flat buffer.

ZeRO-1 keeps every bit16 parameter as a view into ``bit16_groups_flat[i]``.
While the compute side works at an estimate θ̃ (or at θ_t while the commit
θ_{t+1} waits in the all-gather buffer), the committed weights already sit in
a flat buffer of the same layout. Showing them to a reader is re-pointing each
``param.data`` at the same offsets of that buffer: no copy, no memory.
"""

from typing import List, Optional

import torch


class ParamView:
    """Nested re-pointing of a ZeRO-1 optimizer's parameters.

    Args:
        groups: ``round_robin_bit16_groups`` (the module's parameters).
        metas: ``round_robin_bit16_meta`` (their shapes).
        offsets: ``round_robin_bit16_offsets`` (their offsets in the flat buffers).
        compute_flats: ``bit16_groups_flat``, where the parameters live normally.
    """

    def __init__(self, groups, metas, offsets, compute_flats: List[torch.Tensor]):
        self.groups, self.metas, self.offsets, self.compute_flats = groups, metas, offsets, compute_flats
        self.depth = 0  # nesting of show() calls (a read of the committed weights is in progress)
        self._pointed = False  # the parameters point at other buffers than compute_flats

    def _point(self, flats: List[torch.Tensor]) -> None:
        for i, params in enumerate(self.groups):
            for p, meta, offset in zip(params, self.metas[i], self.offsets[i]):
                p.data = flats[i].narrow(0, offset, meta.numel()).view(meta.shape)

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
