"""Host tensors sent to a device in one copy.

Each host-to-device copy is a transfer of its own on a GPU (a launch and, from pageable
memory, a wait), and a forward or an acceptance needs several small inputs. ``Packed``
gathers them as bytes, each part aligned to 8 bytes, sends the buffer once and gives back
views of it with the parts' own shapes and dtypes.
"""

from __future__ import annotations

import torch

ALIGN = 8  # bytes: every part starts where any dtype's view of it may start


class Packed:
    """Host tensors collected for one copy to a device (``send``)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor) -> int:
        """Queue ``tensor`` (on the host); its index in what ``send`` returns."""
        self.parts.append(tensor.contiguous())
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued tensor on ``device``, as views of one buffer copied there once."""
        pieces, sizes = [], []
        for part in self.parts:
            data = part.reshape(-1).view(torch.uint8)
            padding = -len(data) % ALIGN
            pieces.append(torch.cat([data, data.new_zeros(padding)]) if padding else data)
            sizes.append(len(data) + padding)
        buffer = torch.cat(pieces).to(device)
        out = []
        for part, piece in zip(self.parts, buffer.split(sizes), strict=True):
            out.append(piece[: part.numel() * part.element_size()].view(part.dtype).view(part.shape))
        return out
