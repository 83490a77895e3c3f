"""Which segments a PipelineModule recomputes (activation_checkpoint_interval), by DeepSpeed's rule: with
checkpointable_layers, the segments whose layers are all of the listed types; without, the segments that
hold parameters."""
import torch

from zeroengine.pipe import LayerSpec, PipelineModule


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.linear(x)


class Scale(torch.nn.Module):  # no parameters
    def forward(self, x):
        return 2 * x


def recomputed_segments(layers, interval, checkpointable_layers=None) -> list[list[str]]:
    """The layer types of each segment the module handed to its checkpoint function in one forward."""
    seen = []

    def counting_checkpoint(run, *inputs):
        seen.append([type(f).__name__ for f in run.args[0]])
        return run(*inputs)

    model = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=interval,
                           activation_checkpoint_func=counting_checkpoint, checkpointable_layers=checkpointable_layers)
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    return seen


def test_without_a_list_only_segments_with_parameters_are_recomputed():
    layers = [LayerSpec(Block), LayerSpec(Scale), LayerSpec(Scale), LayerSpec(Block), lambda x: x.tanh()]
    assert recomputed_segments(layers, 1) == [["Block"], ["Block"]]
    assert recomputed_segments(layers, 2) == [["Block", "Scale"], ["Scale", "Block"]]  # some parameters: enough


def test_with_a_list_a_segment_is_recomputed_only_when_all_its_layers_are_listed():
    layers = [LayerSpec(Block), LayerSpec(Block), LayerSpec(Block), LayerSpec(Scale)]
    assert recomputed_segments(layers, 2, checkpointable_layers=["Block"]) == [["Block", "Block"]]
    assert recomputed_segments(layers, 2, checkpointable_layers=["Block", "Scale"]) == [["Block", "Block"],
                                                                                         ["Block", "Scale"]]
