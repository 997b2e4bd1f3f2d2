"""A model folder made by one driver while another reads it (two drivers of one study on a
shared filesystem both run ``model.make``): once ``config.json`` is there (what
``needs_making`` reads as "made"), every file of the folder is whole. Before, config.json was
written first and the tokenizer after it, so a second driver could find a folder "made" with
no tokenizer yet."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from optimizer.engine.models import make_model, needs_making


def test_a_folder_with_a_config_is_whole_while_it_is_being_made(tmp_path: Path) -> None:
    for i in range(5):
        folder = tmp_path / f"m{i}"
        maker = threading.Thread(target=make_model, args=(folder, "tiny"))
        maker.start()
        while not (folder / "config.json").exists():
            assert maker.is_alive() or (folder / "config.json").exists()
        assert not needs_making(folder, None)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            json.loads((folder / name).read_text())
        maker.join()
        assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
