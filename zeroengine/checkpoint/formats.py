"""One entry point for reading a tag directory in either format: zeroengine's, or DeepSpeed's (viewed as a
zeroengine manifest by deepspeed/reader.py). The loader, the consolidation functions and the converters all
open checkpoints here, so each reads both formats the same way."""
from __future__ import annotations

import os

from .deepspeed.layout import looks_like_deepspeed
from .deepspeed.reader import DeepSpeedManifest
from .manifest import MANIFEST, Manifest


def read_manifest(tag_dir: str) -> Manifest:
    """The manifest of ``tag_dir``: zeroengine's, or a DeepSpeed checkpoint's files read as one."""
    if not os.path.exists(os.path.join(tag_dir, MANIFEST)) and looks_like_deepspeed(tag_dir):
        return DeepSpeedManifest.read(tag_dir)
    return Manifest.read(tag_dir)
