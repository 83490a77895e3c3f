"""Which files make a DeepSpeed 0.19 checkpoint tag, and whether they are all there.

    <save_dir>/latest                                    the tag (as zeroengine's)
    <tag>/mp_rank_00_model_states.pt                     module, counters, scheduler, client_state (stages 0-2)
    <tag>/zero_pp_rank_R_mp_rank_00_model_states.pt      the same, one per data-parallel rank (stage 3)
    <tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's partition of masters and moments (ZeRO)
    <tag>/layer_LL-model_states.pt                       one per pipeline layer (pipeline runs)
    <tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt   ``ds_to_universal``'s output

A pipeline run saves one ``mp_rank_PP`` set of files per pipeline stage (its
layers' values in the ``layer_LL`` files); each is read as one *part* of the model.
Without layer files, ``mp_rank_01`` ... mean tensor parallelism (Megatron's), which
is refused by name.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..files import CheckpointError

MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_LAYER = re.compile(r"^layer_(?P<layer>\d+)-model_states\.pt$")
_MP = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
UNIVERSAL_DIR = "zero"


def looks_like_deepspeed(folder: str) -> bool:
    """A tag directory DeepSpeed wrote (or ``ds_to_universal``)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(_MP.match(n) or _OPTIM.match(n) or _ZERO3_MODEL.match(n) for n in names)


@dataclass
class DeepSpeedFiles:
    tag_dir: str
    # part (pipeline stage; 0 without a pipeline) -> data-parallel rank -> path (stage 3: every rank has one)
    model_states: dict[int, dict[int, str]] = field(default_factory=dict)
    optim_states: dict[int, dict[int, str]] = field(default_factory=dict)
    layers: dict[int, str] = field(default_factory=dict)  # pipeline layer index -> path
    universal: bool = False

    @classmethod
    def find(cls, tag_dir: str) -> "DeepSpeedFiles":
        names = sorted(os.listdir(tag_dir))
        found = cls(tag_dir)
        for name in names:
            path = os.path.join(tag_dir, name)
            if m := _OPTIM.match(name):
                found.optim_states.setdefault(int(m["mp"]), {})[int(m["rank"])] = path
            elif m := _ZERO3_MODEL.match(name):
                found.model_states.setdefault(int(m["mp"]), {})[int(m["rank"])] = path
            elif m := _LAYER.match(name):
                found.layers[int(m["layer"])] = path
            elif m := _MP.match(name):
                found.model_states.setdefault(int(m["mp"]), {}).setdefault(0, path)
        found.universal = os.path.isdir(os.path.join(tag_dir, UNIVERSAL_DIR))
        parts = sorted(set(found.model_states) | set(found.optim_states))
        if parts and parts != [0] and not found.layers:
            raise CheckpointError(f"{tag_dir} is a tensor-parallel DeepSpeed checkpoint (mp_rank_{parts[1]:02d} files, "
                                  "no pipeline layer files): zeroengine reads DeepSpeed checkpoints of one model-"
                                  "parallel rank or of pipelines; consolidate it with DeepSpeed's zero_to_fp32 first")
        missing = [p for p in range(max(parts, default=0) + 1) if 0 not in found.model_states.get(p, {})]
        if missing:
            raise CheckpointError(f"DeepSpeed checkpoint {tag_dir} has no mp_rank_{missing[0]:02d}_model_states.pt "
                                  f"(nor a zero_pp_rank_0_mp_rank_{missing[0]:02d}_model_states.pt): the save did not "
                                  "finish, or the file was removed")
        return found

    @property
    def parts(self) -> list[int]:
        return sorted(self.model_states)

    def check_ranks(self, dp_world_size: int, stage: int) -> None:
        """Every rank's optimizer file (ZeRO) and, at stage 3, model-states file must be there, for each part."""
        if self.universal:
            return
        expected = set(range(dp_world_size))
        for part in self.parts:
            wanted = [("optimizer-state", self.optim_states.get(part, {}))] if stage > 0 else []
            if stage == 3:
                wanted.append(("model-state", self.model_states[part]))
            for what, files in wanted:
                missing = sorted(expected - set(files))
                if missing:
                    raise CheckpointError(
                        f"DeepSpeed checkpoint {self.tag_dir} was saved by {dp_world_size} data-parallel rank(s) but "
                        f"lacks the {what} file(s) of rank(s) {missing} (e.g. zero_pp_rank_{missing[0]}_mp_rank_"
                        f"{part:02d}_{'optim' if what.startswith('optim') else 'model'}_states.pt): it is "
                        "incomplete; nothing was loaded")
                extra = sorted(set(files) - expected)
                if extra:
                    raise CheckpointError(f"DeepSpeed checkpoint {self.tag_dir} says dp_world_size {dp_world_size} "
                                          f"but has {what} files of rank(s) {extra} too: files of two saves are mixed")
