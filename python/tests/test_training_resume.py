"""The training study's runs survive a stop: a run of examples/python/lm.py stopped after a
checkpoint and started again with the same arguments ends with the losses of a run that was never
interrupted, bit for bit (model, optimiser, data order, torch's generator and the Positional LSH
partition counters are all in the checkpoint)."""

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import lm  # noqa: E402

if shutil.which("bible") is None:
    pytest.skip("the training text needs Debian's bible-kjv (apt-get install bible-kjv)",
                allow_module_level=True)

TINY = ["--layers", "1", "--d-model", "32", "--heads", "4", "--length", "32", "--batch", "2",
        "--steps", "9", "--warmup", "2", "--eval-every", "3", "--log-every", "100",
        "--curve-bytes", "256", "--eval-bytes", "512", "--eval-multiples", "1,2"]


def arguments(tmp_path, variant, name, *extra):
    return lm.parser().parse_args(
        ["--variant", variant, *TINY, "--data-cache", str(tmp_path / "kjv.txt"),
         "--out", str(tmp_path / f"{name}.json"), *extra])


@pytest.mark.parametrize("variant,extra", [
    ("plsh", ["--samples", "5", "--activation-checkpointing"]),
    ("alibi", []),
])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, variant, extra):
    whole = lm.run(arguments(tmp_path, variant, "whole", *extra))
    checkpoint = str(tmp_path / "state.pt")
    # Stopped twice: after 4 steps (between two evaluations) and after 6 (on one).
    for stop in (4, 6):
        stopped = lm.run(arguments(tmp_path, variant, "resumed", *extra, "--checkpoint", checkpoint,
                                   "--stop-at-step", str(stop)))
        assert stopped is None and os.path.exists(checkpoint)
        assert not os.path.exists(tmp_path / "resumed.json")
    resumed = lm.run(arguments(tmp_path, variant, "resumed", *extra, "--checkpoint", checkpoint))
    assert resumed["processes"] == 3 and whole["processes"] == 1
    assert not os.path.exists(checkpoint)
    assert resumed["train_losses"] == whole["train_losses"]
    assert [c[:2] for c in resumed["curve"]] == [c[:2] for c in whole["curve"]]
    assert resumed["eval"] == whole["eval"]
    assert len(whole["train_losses"]) == 9
    assert [c[0] for c in whole["curve"]] == [0, 3, 6, 9]


def test_a_checkpoint_of_other_arguments_is_refused(tmp_path):
    checkpoint = str(tmp_path / "state.pt")
    lm.run(arguments(tmp_path, "alibi", "run", "--checkpoint", checkpoint, "--stop-at-step", "2"))
    with pytest.raises(SystemExit, match="lr"):
        lm.run(arguments(tmp_path, "alibi", "run", "--checkpoint", checkpoint, "--lr", "0.01"))
