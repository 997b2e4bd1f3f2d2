"""What a trial's node must see (issue 45, item 4): the paths the driver names for a trial
(:func:`optimizer.runners.paths_to_see`) and the check on the node
(:func:`optimizer.runners.check_node_sees`); tests/integration/test_cluster_placement.py runs
it on a real cluster."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.errors import ConfigError
from optimizer.runners import check_node_sees, paths_to_see
from tests.fakes.gated import tiny_spec


def test_the_driver_names_the_nearest_folder_it_sees_the_model_path_and_the_interpreter(
    tmp_path: Path,
) -> None:
    (tmp_path / "study").mkdir()
    (tmp_path / "model").mkdir()
    spec = tiny_spec(tmp_path / "study" / "trials" / "0003" / "attempt-0", 3)
    assert paths_to_see(spec) == (("the study folder", str(tmp_path / "study")),)
    local = replace(
        tiny_spec(tmp_path / "study", 3, model=str(tmp_path / "model")), python=sys.executable
    )
    assert paths_to_see(local) == (
        ("the trial folder", str(tmp_path / "study")),
        ("the model", str(tmp_path / "model")),
        ("the interpreter", sys.executable),
    )
    # A model id of a hub is no path here: nothing to see.
    hub = tiny_spec(tmp_path / "study", 3, model="org/not-a-folder-here")
    assert [what for what, _ in paths_to_see(hub)] == ["the trial folder"]


def test_a_node_missing_a_path_is_an_error_naming_each_path_and_the_node(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path / "gone" / "trial", 5)
    check_node_sees(spec, (("the study folder", str(tmp_path)),))  # sees it: nothing raised
    must = (("the study folder", str(tmp_path / "gone")), ("the model", str(tmp_path / "m")))
    with pytest.raises(ConfigError) as info:
        check_node_sees(spec, must)
    message = str(info.value)
    assert f"trial 5 landed on {socket.gethostname()} (no Ray)" in message, message
    assert f"the study folder {tmp_path / 'gone'} nor the model {tmp_path / 'm'}" in message
    assert not (tmp_path / "gone").exists()
