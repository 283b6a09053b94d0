"""Packing: many small tensors into a few flat buffers, and back.

One collective call on a large buffer costs far less than one call per small tensor,
because launch latency dominates small messages. Every packing user in unison shares
these pure functions: the in-process CrossDeviceOps (``num_packs``), the cross-process
CollectiveAllReduce (``bytes_per_pack``) and gradient bucketing.

Equivalents: TensorFlow's ``cross_device_utils.group_by_size``, the
``_ConcatAndSplitPacker`` behind ``AllReduceCrossDeviceOps(num_packs=...)`` and
tensorpack's ``GradientPacker``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from unison._collectives.transport.in_process import check_grads
from unison.errors import UsageError

__all__ = [
    "group_by_size",
    "split_sizes",
    "split_evenly",
    "flatten_tensors",
    "unflatten_tensors",
    "TensorPacker",
]


SizeLike = torch.Tensor | int
ShapeLike = torch.Tensor | torch.Size | Sequence[int]
# A run of tensors packed together: (tensor indices, slice lengths of their flat buffer);
# lengths None means the single tensor travels unpacked.
_Segment = tuple[list[int], list[int] | None]


def check_count(name: str, value: object, minimum: int | None = None) -> int:
    """Returns ``value`` if it is an int (>= ``minimum`` when given); else raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}")
    return value


def _nbytes(item: object, index: int) -> int:
    """Byte size of a dense tensor, or an explicit non-negative byte count."""
    field = f"tensors_or_sizes[{index}]"
    if isinstance(item, torch.Tensor):
        if item.layout != torch.strided:
            raise TypeError(
                f"`{field}` is a {item.layout} tensor: only dense tensors are packed; "
                f"reduce sparse tensors separately (e.g. by all-gather of indices and values)"
            )
        return item.numel() * item.element_size()
    return check_count(field, item, 0)


def group_by_size(tensors_or_sizes: Sequence[SizeLike], bytes_per_pack: int) -> list[list[int]]:
    """Partitions indices, in order, into consecutive groups of about ``bytes_per_pack``.

    A group closes as soon as its bytes reach ``bytes_per_pack``, so every group but the
    last holds at least ``bytes_per_pack`` bytes and packs err on the side of few and
    large. This is how CollectiveAllReduce batches all-reduces.

    TF equivalent: ``cross_device_utils.group_by_size``, which returns the tensors
    themselves and closes a group only once it *exceeds* the threshold.

    Args:
        tensors_or_sizes: dense tensors (size = ``numel * element_size``) or byte counts.
        bytes_per_pack: target bytes per group; ``<= 0`` puts everything in one group.

    Returns:
        Lists of indices into ``tensors_or_sizes``; ``[]`` when it is empty.

    Raises:
        TypeError: if an item is neither a dense tensor nor an int, or if
            ``tensors_or_sizes`` is a single tensor.
        ValueError: if a byte count is negative.
    """
    if isinstance(tensors_or_sizes, torch.Tensor):
        raise TypeError("`tensors_or_sizes` must be a list of tensors or byte counts, not one tensor: wrap it as [t]")
    bytes_per_pack = check_count("bytes_per_pack", bytes_per_pack)
    return _group_sizes([_nbytes(item, i) for i, item in enumerate(tensors_or_sizes)], bytes_per_pack)


def _group_sizes(sizes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """``group_by_size`` on checked byte counts."""
    if not sizes:
        return []
    if bytes_per_pack <= 0:
        return [list(range(len(sizes)))]
    groups: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        if filled >= bytes_per_pack:
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += size
    return groups


def split_sizes(total: int, num_packs: int) -> list[int]:
    """Lengths of ``num_packs`` consecutive slices of a flat buffer of ``total`` elements.

    The rule of TF's ``_ConcatAndSplitPacker`` and tensorpack's ``GradientPacker``: all
    slices get ``total // num_packs`` elements and the last also takes the remainder.
    Unlike TF, there are never empty slices: a buffer smaller than ``num_packs`` gets one
    slice per element (one empty slice when ``total == 0``).

    Raises:
        ValueError: if ``total < 0`` or ``num_packs < 1``.
    """
    check_count("total", total, 0)
    check_count("num_packs", num_packs, 1)
    parts = max(1, min(num_packs, total))
    size = total // parts
    return [size] * (parts - 1) + [total - size * (parts - 1)]


def split_evenly(n_items: int, num_packs: int) -> list[list[int]]:
    """Partitions ``range(n_items)`` into ``num_packs`` consecutive groups by :func:`split_sizes`.

    ``num_packs == 0`` means no packing: one group per item (TF's ``num_packs=0``).

    Raises:
        ValueError: if ``n_items`` or ``num_packs`` is negative.
    """
    check_count("n_items", n_items, 0)
    check_count("num_packs", num_packs, 0)
    if n_items == 0:
        return []
    if num_packs == 0:
        return [[i] for i in range(n_items)]
    groups, start = [], 0
    for size in split_sizes(n_items, num_packs):
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def flatten_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copies ``tensors`` into one new contiguous 1-D buffer, in order.

    The buffer never aliases an input, so reducing it in place is safe.
    PyTorch equivalent: ``torch._utils._flatten_dense_tensors``.

    Raises:
        ValueError: if ``tensors`` is empty or mixes dtypes or devices.
        TypeError: if an item is not a dense tensor.
    """
    if isinstance(tensors, torch.Tensor) or len(tensors) == 0:
        raise ValueError("`tensors` must be a non-empty list of tensors to flatten")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"`tensors[{i}]` must be a dense torch.Tensor, got {type(t).__name__}")
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"`tensors[{i}]` is {t.dtype} on {t.device} but `tensors[0]` is {first.dtype} on "
                f"{first.device}: one flat buffer needs one dtype and one device; group by dtype first"
            )
    return torch.cat([t.reshape(-1) for t in tensors])


def _shape_of(item: ShapeLike) -> torch.Size:
    return item.shape if isinstance(item, torch.Tensor) else torch.Size(item)


def unflatten_tensors(flat: torch.Tensor, like: Sequence[ShapeLike]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like ``like`` (tensors or shapes), the inverse of flattening.

    PyTorch equivalent: ``torch._utils._unflatten_dense_tensors``.

    Raises:
        ValueError: if ``flat`` is not 1-D or its length is not the total size of ``like``.
    """
    shapes = [_shape_of(item) for item in like]
    sizes = [shape.numel() for shape in shapes]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(
            f"`flat` has shape {tuple(flat.shape)} but `like` needs a 1-D buffer of {sum(sizes)} "
            f"elements; pass the buffer that flatten_tensors returned for these tensors"
        )
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


class TensorPacker:
    """Packs K devices' lists of N tensors into K x P flat packs, and unpacks K x P to K x N.

    Tensors of different dtypes never share a pack: each dtype (in order of first use)
    is packed on its own. With ``num_packs=P`` every dtype's tensors are concatenated and
    cut into ``P`` slices of about equal size (slices may span tensor boundaries); with
    ``bytes_per_pack=B`` they are grouped at tensor boundaries by :func:`group_by_size`.
    ``num_packs=0`` packs nothing: the packs are the input tensors themselves. Packs
    otherwise are fresh buffers, so reducing them in place does not touch the inputs.

    ``pack`` records the layout that ``unpack`` uses; call ``pack`` again for new inputs.

    TF equivalent: ``_pack_tensors`` / ``_unpack_tensors`` with ``_ConcatAndSplitPacker``
    in ``cross_device_ops.py``, which fails on mixed dtypes instead of grouping them.

    Example:
        >>> packer = TensorPacker(num_packs=2)
        >>> packs = packer.pack([[torch.ones(3), torch.ones(2, 2)], [torch.zeros(3), torch.zeros(2, 2)]])
        >>> summed = [packs[0][p] + packs[1][p] for p in range(len(packs[0]))]
        >>> [t.shape for t in packer.unpack([summed, summed])[0]]
        [torch.Size([3]), torch.Size([2, 2])]

    Args:
        num_packs: packs per dtype; 0 means no packing. Default 1 when neither is given.
        bytes_per_pack: target bytes per pack (``<= 0``: one pack per dtype).

    Raises:
        ValueError: if both are given or ``num_packs`` is negative.
    """

    def __init__(self, num_packs: int | None = None, bytes_per_pack: int | None = None) -> None:
        if num_packs is not None and bytes_per_pack is not None:
            raise ValueError(
                f"give `num_packs` ({num_packs!r}) or `bytes_per_pack` ({bytes_per_pack!r}), not both"
            )
        # _count is bytes per pack when bytes_per_pack is given, else packs per dtype.
        if bytes_per_pack is not None:
            self._count = check_count("bytes_per_pack", bytes_per_pack)
        else:
            self._count = num_packs = check_count("num_packs", 1 if num_packs is None else num_packs, 0)
        self.num_packs = num_packs
        self.bytes_per_pack = bytes_per_pack
        self._shapes: list[torch.Size] | None = None
        self._segments: list[_Segment] = []

    def _plan(self, tensors: Sequence[torch.Tensor]) -> list[_Segment]:
        if self.num_packs == 0:
            return [([i], None) for i in range(len(tensors))]
        # Read each tensor's dtype and numel once: this runs on every packed all-reduce,
        # and per-tensor attribute reads are most of its cost for hundreds of tensors.
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        numels = [t.numel() for t in tensors]
        segments: list[_Segment] = []
        for dtype, indices in by_dtype.items():
            if self.bytes_per_pack is None:
                segments.append((indices, split_sizes(sum(numels[i] for i in indices), self._count)))
                continue
            itemsize = dtype.itemsize
            for group in _group_sizes([numels[i] * itemsize for i in indices], self._count):
                members = [indices[g] for g in group]
                segments.append((members, [sum(numels[i] for i in members)]))
        return segments

    def pack(self, device_tensors: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Returns K lists of P packs; pack ``p`` has the same size on every device.

        Raises:
            ValueError / TypeError: if the lists are ragged, empty, or differ in shape or
                dtype across devices, or a device's tensors span several devices.
        """
        check_grads(device_tensors, "device_tensors")
        self._shapes = [t.shape for t in device_tensors[0]]
        self._segments = self._plan(device_tensors[0])
        out = []
        for tensors in device_tensors:
            packs: list[torch.Tensor] = []
            for indices, splits in self._segments:
                if splits is None:
                    packs.append(tensors[indices[0]])
                    continue
                # grouped by dtype in _plan, and torch.cat refuses mixed devices: no per-tensor checks
                flat = torch.cat([tensors[i] if tensors[i].dim() == 1 else tensors[i].reshape(-1) for i in indices])
                packs.extend(flat.split(splits) if len(splits) > 1 else [flat])
            out.append(packs)
        return out

    def unpack(self, device_packs: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Returns K lists of N tensors shaped like the last ``pack`` input.

        The tensors are views of the packs (of their concatenation when a dtype has
        several packs), so they cost no copy beyond that concatenation.

        Raises:
            RuntimeError: if ``pack`` was never called.
            ValueError: if the packs do not match the recorded layout.
        """
        if self._shapes is None:
            raise UsageError(
                "TensorPacker.unpack needs the layout of a prior TensorPacker.pack call: call pack() first"
            )
        expected = sum(1 if s is None else len(s) for _, s in self._segments)
        out = []
        for k, packs in enumerate(device_packs):
            if len(packs) != expected:
                raise ValueError(
                    f"`device_packs[{k}]` has {len(packs)} packs but pack() produced {expected}: "
                    f"pass the reduced packs in the order pack() returned them"
                )
            tensors: dict[int, torch.Tensor] = {}
            cursor = 0
            for indices, splits in self._segments:
                count = 1 if splits is None else len(splits)
                chunk = list(packs[cursor : cursor + count])
                cursor += count
                if splits is None:
                    tensors[indices[0]] = chunk[0].reshape(self._shapes[indices[0]])
                    continue
                flat = chunk[0] if count == 1 else torch.cat(chunk)
                shapes = [self._shapes[i] for i in indices]
                for i, shape, piece in zip(indices, shapes, flat.split([shape.numel() for shape in shapes])):
                    tensors[i] = piece if len(shape) == 1 else piece.view(shape)
            out.append([tensors[i] for i in range(len(self._shapes))])
        return out


