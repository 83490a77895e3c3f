"""Real text every machine has: the Python standard library's own source, read as bytes.

Byte-level (vocabulary 256), so there is no tokenizer to download; the files are read in sorted order up to
``max_bytes``, so every rank of a run (one Python installation) sees the same corpus.
"""
from __future__ import annotations

import os
import sysconfig

import torch


def python_source_bytes(max_bytes: int) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's ``.py`` files (the top folder first, then its packages), as
    a uint8 tensor."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idle_test", "site-packages", "__pycache__"))
        paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    chunks, size = [], 0
    for path in paths:
        if size >= max_bytes:
            break
        with open(path, "rb") as f:
            data = f.read(max_bytes - size)
        chunks.append(data)
        size += len(data)
    if size == 0:
        raise FileNotFoundError(f"no Python source found under {root} to train on")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class PythonSourceBytes(torch.utils.data.Dataset):
    """Windows of ``block_size + 1`` bytes (inputs, and the same shifted by one as targets), back to back."""

    def __init__(self, block_size: int, max_bytes: int = 4_000_000):
        data = python_source_bytes(max_bytes).long()
        count = (len(data) - 1) // block_size
        self.windows = data[:count * block_size + 1]
        self.block_size = block_size
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        start = i * self.block_size
        window = self.windows[start:start + self.block_size + 1]
        return window[:-1], window[1:]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the windows ``indices`` (ints or a 1-D tensor), stacked: ``[len, block_size]``
        each."""
        x, y = zip(*(self[int(i)] for i in indices))
        return torch.stack(x), torch.stack(y)


@torch.no_grad()
def sample(model, prompt: bytes, new_bytes: int, block_size: int, device, temperature: float = 0.8,
           seed: int = 0) -> bytes:
    """``prompt`` continued by ``new_bytes`` bytes drawn from ``model`` (logits from ``model(idx)``). Every rank
    draws the same bytes (one seed), so at ZeRO stage 3 all of them run the same forwards."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    for _ in range(new_bytes):
        logits = model(idx[:, -block_size:])[0, -1].float().cpu() / temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt.to(device).view(1, 1)], dim=1)
    return bytes(idx[0].tolist())
