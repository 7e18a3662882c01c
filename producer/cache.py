"""Producer-side output cache: genlm-backend's ``OutputCache(maxsize, move_to_cpu)``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch


class OutputCache:
    """LRU of tensors; with ``move_to_cpu`` values are kept on CPU and returned on their device."""

    def __init__(self, maxsize: int, move_to_cpu: bool = False) -> None:
        if maxsize < 0:
            raise ValueError("maxsize must be >= 0")
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self.cache: OrderedDict[Hashable, tuple[torch.device, torch.Tensor]] = OrderedDict()

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        device, value = self.cache.pop(key)
        self.cache[key] = (device, value)
        return value.to(device) if self.move_to_cpu else value

    def get(self, key: Hashable) -> torch.Tensor | None:
        try:
            return self[key]
        except KeyError:
            return None

    def __setitem__(self, key: Hashable, value: torch.Tensor) -> None:
        if self.maxsize == 0:
            return
        self.cache.pop(key, None)
        while len(self.cache) >= self.maxsize:
            self.cache.popitem(last=False)
        self.cache[key] = (value.device, value.cpu() if self.move_to_cpu else value)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.cache

    def __len__(self) -> int:
        return len(self.cache)

    def clear(self) -> None:
        self.cache.clear()
