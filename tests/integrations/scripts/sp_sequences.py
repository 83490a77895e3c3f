"""The data of the sequence-parallel integration scripts (hf_trainer_sp.py, accelerate_sp.py): fixed random token
sequences with ``position_ids`` (the sequence-parallel attention needs them) and a -100 prompt, so that the pieces
of a sequence hold different numbers of scored tokens."""
import torch

LENGTH, PROMPT, VOCAB = 16, 5, 64


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:PROMPT] = -100
        return {"input_ids": self.ids[i], "position_ids": torch.arange(LENGTH), "labels": labels}
