"""`diffpipe export RUN --step N` of a full fine-tune: a checkpoint's weights, read into the model built as one stage
whatever layout wrote them, exported as the finished run's weights are."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from diffpipe.cli import main


def test_the_last_checkpoint_exports_the_final_weights_and_an_earlier_one_its_own(full_run, tmp_path):
    final = load_file(str(full_run / "model.safetensors"))
    exported = {}
    for step in (6, 3):
        out = tmp_path / f"step{step}.safetensors"
        assert main(["export", str(full_run), "--format", "diffusers", "--out", str(out), "--step", str(step)]) == 0
        exported[step] = load_file(str(out))
    assert exported[6].keys() == final.keys()
    assert all(torch.equal(exported[6][k], final[k]) for k in final)
    assert any(not torch.equal(exported[3][k], final[k]) for k in final)
